"""OpenMP thread pools of the device's worker and of host threads (issue 12).

libgomp keeps a pool of helper threads per thread that started a parallel region, and spins a helper
between regions only while all pools' helpers do not outnumber the CPUs. A worker's pool next to the host
thread's pool outnumbered 2 CPUs, so every CPU kernel of the process -- the user's CPU code included -- paid
a futex sleep and wake-up per region (1.6x slower CPU training steps once a neuron kernel had run). The
worker ends its pool when idle, and a host thread ends its own at a launch. Asserted on thread counts (what
libgomp keeps alive), in a fresh interpreter so no other test's threads are counted.
"""

from __future__ import annotations

from _neuron_child import run_child


def test_the_worker_and_a_launching_host_thread_end_their_idle_openmp_pools() -> None:
    facts = run_child(
        """
import os, threading, time
import torch
import torchneuron_lab  # noqa: F401

def named(name):
    return sum(1 for t in os.listdir("/proc/self/task")
               if open(f"/proc/self/task/{t}/comm").read().strip() == name)

main = open("/proc/self/comm").read().strip()
facts = {"threads": torch.get_num_threads()}
x = torch.randn(1 << 21, device="neuron")
x.add_(1)                                         # the first launch of a plan runs on the host: twice
x.add_(1)
torch.neuron.synchronize()
x0 = x.cpu()
time.sleep(0.2)
torch.randn(1 << 21).add_(1)                      # a parallel CPU kernel: the main thread's pool
facts["main_after_cpu"] = named(main)
x.add_(1)                                         # a launch: the main thread's pool ends
facts["main_after_launch"] = named(main)
def count_while_busy():
    # the worker's kernels ran (the event) and it is still busy (the sleep): its pool is counted, not idle
    done = torch.neuron.Event()
    done.record()
    torch.neuron._sleep(400)
    done.synchronize()
    n = named("neuron0:s0")
    torch.neuron.synchronize()
    return n

for _ in range(19):
    x.add_(1)                                     # parallel kernels on the worker: its pool
facts["worker_busy"] = count_while_busy()
time.sleep(0.5)                                   # idle > 20 ms: the worker's pool ends
facts["worker_idle"] = named("neuron0:s0")
x.add_(1)
facts["worker_again"] = count_while_busy()        # the next parallel kernel made a new pool
ref = x0.clone()
for _ in range(21):
    ref.add_(1)
facts["value"] = torch.equal(x.cpu(), ref)  # bit-identical to CPU
emit(facts)
""",
        outcomes=True,
    )
    assert facts["threads"] == 2, facts
    assert facts["main_after_launch"] == facts["main_after_cpu"] - 1  # its one helper (regions of two) ended
    assert facts["worker_busy"] == 2  # the worker and its helper
    assert facts["worker_idle"] == 1
    assert facts["worker_again"] == 2
    assert facts["value"]


def test_autograd_device_threads_do_not_keep_an_openmp_pool_after_running_kernels_on_the_host() -> None:
    # Backward runs on autograd's device thread (pt_autograd_0, as for CUDA). Kernels it runs on the host
    # (TORCHNEURON_LAB_LAUNCH_BLOCKING=1: all of them; otherwise a plan's first launch, sync ops) made an
    # OpenMP pool on that thread, which then never launched again to end it: the pools outnumbered the
    # CPUs and the user's CPU code after training ran 2-3x slower (the benchmarks' CPU baseline guard).
    facts = run_child(
        """
import os, time
import torch
import torchneuron_lab  # noqa: F401
from torchneuron_lab.device._backend import lib

def named(prefix):
    return sorted(n for n in (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
                  if n.startswith(prefix))

facts = {}
for blocking in (True, False):
    lib().set_launch_blocking(blocking)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    md = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to("neuron")
    md.load_state_dict(m.state_dict())
    x = torch.randn(256, 512)
    for mod, xx in ((m, x), (md, x.to("neuron"))):
        for _ in range(3):
            mod.zero_grad()
            mod(xx).square().sum().backward()  # matmuls of 256x512: parallel regions, on both sides
    torch.neuron.synchronize()
    time.sleep(0.2)
    facts[f"autograd_threads_blocking_{blocking}"] = named("pt_autograd_")
    facts[f"grads_equal_blocking_{blocking}"] = all(
        torch.equal(a.grad, b.grad.cpu()) for a, b in zip(m.parameters(), md.parameters()))
emit(facts)
""",
        env={"TORCHNEURON_LAB_LAUNCH_BLOCKING": "1"},
        outcomes=True,
    )
    # one autograd thread per device (2), none with a helper thread of its own (the helper has its name)
    assert facts["autograd_threads_blocking_True"] == ["pt_autograd_0", "pt_autograd_1"], facts
    assert facts["autograd_threads_blocking_False"] == ["pt_autograd_0", "pt_autograd_1"], facts
    assert facts["grads_equal_blocking_True"] and facts["grads_equal_blocking_False"], facts
