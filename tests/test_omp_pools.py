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
