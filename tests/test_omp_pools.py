"""OpenMP thread pools of the device's worker and of host threads (issue 12).

libgomp keeps a pool of helper threads per thread that started a parallel region, and spins a helper
between regions only while all pools' helpers do not outnumber the CPUs. A worker's pool next to the host
thread's pool outnumbered 2 CPUs, so every CPU kernel of the process -- the user's CPU code included -- paid
a futex sleep and wake-up per region (1.6x slower CPU training steps once a neuron kernel had run). The
worker ends its pool when idle, and a host thread ends its own at a launch. Asserted on thread counts (what
libgomp keeps alive), in a fresh interpreter so no other test's threads are counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _neuron_child import run_child

# The pools' counts asserted here (a worker and its one helper, pools against CPUs) are those of 2 threads on
# 2 CPUs, the machine kind this was measured on: each child is pinned to (at most) 2 CPUs before torch loads
# libgomp, which counts the CPUs it may use once, and runs torch's regions with as many threads as CPUs.
_PIN = "import os\nos.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])\n"
_THREADS = "torch.set_num_threads(len(os.sched_getaffinity(0)))\n"


def test_the_worker_and_a_launching_host_thread_end_their_idle_openmp_pools() -> None:
    facts = run_child(
        _PIN
        + """
import os, threading, time
import torch
import torchneuron_lab  # noqa: F401
"""
        + _THREADS
        + """

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


_SPREAD_CHILD = (
    """
import os, time
"""
    + _PIN
    + """
import torch
import torchneuron_lab  # noqa: F401
from torchneuron_lab.device._backend import lib
"""
    + _THREADS
    + """

C = lib()

def worker_threads():
    out = []
    for t in os.listdir("/proc/self/task"):
        if open(f"/proc/self/task/{t}/comm").read().strip() == "neuron0:s0":
            allowed = [l.split(":", 1)[1].strip() for l in open(f"/proc/self/task/{t}/status")
                       if l.startswith("Cpus_allowed_list")][0]
            out.append(allowed)
    return out

def busy(x):
    done = torch.neuron.Event()
    for _ in range(20):
        x.add_(1)                                  # parallel kernels (2M elements) on the worker
    done.record()
    torch.neuron._sleep(300)
    done.synchronize()                             # its kernels ran; it is still busy: its pool is there
    threads = worker_threads()
    torch.neuron.synchronize()
    return threads

facts = {"process": [l.split(":", 1)[1].strip() for l in open("/proc/self/status")
                     if l.startswith("Cpus_allowed_list")][0]}
x = torch.randn(1 << 21, device="neuron")
x.add_(1)
torch.neuron.synchronize()
time.sleep(0.2)                                    # idle: any pool ended
s0 = C.spin_throttle_stats()
facts["first"] = busy(x)
s1 = C.spin_throttle_stats()
time.sleep(0.3)                                    # idle > 20 ms: the worker's pool ends
facts["again"] = busy(x)
s2 = C.spin_throttle_stats()
C.set_pool_spread(False)
time.sleep(0.3)
facts["off"] = busy(x)
s3 = C.spin_throttle_stats()
facts["spread"] = [s1["pools_spread"] - s0["pools_spread"], s2["pools_spread"] - s1["pools_spread"],
                   s3["pools_spread"] - s2["pools_spread"]]
facts["mode"] = [s0["spread"], s3["spread"]]
facts["last"] = [list(s1["spread_last"]), list(s2["spread_last"])]
C.set_pool_spread(True)
time.sleep(0.3)
side = torch.neuron.Stream()
s4 = C.spin_throttle_stats()
with torch.neuron.stream(side):
    torch.neuron._sleep(300)                       # a side stream's worker runs nothing parallel
side.synchronize()
named = sum(1 for t in os.listdir("/proc/self/task")
            if open(f"/proc/self/task/{t}/comm").read().strip() == f"neuron0:s{side.stream_id}")
facts["side_stream"] = [C.spin_throttle_stats()["pools_spread"] - s4["pools_spread"], named]
ref = torch.randn(1 << 21)
facts["equal"] = torch.equal(ref.to("neuron").add(1).sum().cpu(), ref.add(1).sum())
emit(facts)
"""
)


def test_a_new_worker_pool_has_its_helpers_placed_once_and_their_affinity_given_back() -> None:
    # A helper libgomp has just created was, in about half of the pools, left where it slowed every region
    # of the pool's life (a + 1 on 1024^2: 80-90 us a region instead of 50-56). Each new pool of a worker is
    # made by one region that moves its helpers off the worker's CPU and gives them back their affinity.
    facts = run_child(_SPREAD_CHILD, outcomes=True)
    assert facts["mode"] == [True, False], facts
    assert facts["spread"] == [1, 1, 0], facts  # once per pool made, none when turned off
    for worker_cpu, helper_cpu in facts["last"]:  # the helper was moved to a CPU other than the worker's
        assert worker_cpu >= 0 and helper_cpu >= 0 and helper_cpu != worker_cpu, facts
    for key in ("first", "again", "off"):
        assert len(facts[key]) == 2, facts  # the worker and its one helper (regions of two threads)
        assert all(allowed == facts["process"] for allowed in facts[key]), facts  # affinity given back
    assert facts["equal"] is True
    assert facts["side_stream"] == [0, 1], facts  # a side stream's worker: no placement, no pool of its own


def test_a_worker_allowed_one_cpu_is_not_moved() -> None:
    # taskset to one CPU: nothing to spread to; the pool's helper keeps the one CPU it may use
    code = _SPREAD_CHILD.replace("import os, time", "import os, time\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})")
    facts = run_child(code, outcomes=True)
    assert "," not in facts["process"] and "-" not in facts["process"], facts
    assert facts["last"][0][1] == -1, facts  # no helper was moved
    assert all(allowed == facts["process"] for key in ("first", "again", "off") for allowed in facts[key]), facts
    assert facts["equal"] is True


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


# The spin throttle (device/csrc/queue.cpp). Between parallel regions libgomp spins a pool's helper for
# milliseconds unless pools outnumber the CPUs. It does not count the host thread, so a device that waits for
# the host (a host-bound loop) had its worker's helper spinning on the core the host's Python needs. A worker
# starved in two 10 ms windows makes one more pool (a sleeping helper of ours), so libgomp throttles the spin;
# a device the host runs ahead of keeps its spinning helper. The child is pinned to 2 CPUs and 2 threads (the
# machine this was measured on), so the count of pools against CPUs is the same on any CI machine.
_THROTTLE_CHILD = (
    _PIN
    + """
import os, time
import torch
import torchneuron_lab  # noqa: F401
from torchneuron_lab.device._backend import lib
"""
    + _THREADS
    + """
C = lib()

def helper_cpu_ns():
    # CPU time of the worker's OpenMP helpers: threads named as the worker (libgomp's threads inherit the
    # name of the thread that made them) other than the worker, the first of them
    named = []
    for t in os.listdir("/proc/self/task"):
        try:
            f = open(f"/proc/self/task/{t}/stat").read()
        except OSError:
            continue
        if f[f.index("(") + 1:f.rindex(")")] == "neuron0:s0":
            p = f[f.rindex(")") + 2:].split()
            named.append((int(t), (int(p[11]) + int(p[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")))
    return sum(ns for _, ns in sorted(named)[1:])

def host_bound(seconds):
    # a parallel kernel (1<<16 elements: 2 threads) every ~100 us of host Python: the worker waits for launches
    a = torch.randn(1 << 16, device="neuron")
    c0, t0 = helper_cpu_ns(), time.perf_counter_ns()
    out = a
    while time.perf_counter_ns() - t0 < seconds * 1e9:
        out = a + 1
        s = 0
        for i in range(1500):
            s += i
    torch.neuron.synchronize()
    return (helper_cpu_ns() - c0) / (time.perf_counter_ns() - t0), out
"""
)


def _in_fresh_processes(code: str, check: Callable[[dict[str, Any]], None], attempts: int = 3) -> dict[str, Any]:
    """The throttle decides from 10 ms windows of a shared 2-vCPU VM's timing, so one process can see a
    scheduling hiccup cross a threshold (an Intel machine: 1 failure in ~12 runs per case, none on the AMD
    ones). A case gets up to ``attempts`` fresh processes and passes on the first whose facts show the designed
    behaviour; a broken rule fails all of them (the facts of each are in the error)."""
    seen = []
    for _ in range(attempts):
        facts = run_child(code, outcomes=True)
        try:
            check(facts)
            return facts
        except AssertionError as e:
            seen.append(f"{facts}: {e}")
    raise AssertionError(f"in {attempts} fresh processes:\n" + "\n".join(seen))


def test_a_starved_worker_throttles_its_openmp_helpers_spin_and_an_idle_one_gives_it_back() -> None:
    def check(facts: dict[str, Any]) -> None:
        assert facts["default_mode"] == "auto"
        assert facts["off_stats"]["engaged"] == 0 and facts["off_stats"]["held"] is False
        # off: the helper spins most of the loop; throttled: it sleeps between the kernels
        assert facts["off_share"] > 0.5, facts
        assert facts["engaged"] == 1 and facts["held_during"] is True, facts
        assert facts["starved_windows"] >= 2, facts
        assert facts["auto_share"] < 0.6 * facts["off_share"], facts
        assert facts["sum_equal"] is True
        assert facts["held_after_idle"] is False and facts["released"] == 1, facts

    _in_fresh_processes(
        _THROTTLE_CHILD
        + """
facts = {"default_mode": C.spin_throttle_stats()["mode"]}
C.set_spin_throttle("off")
host_bound(0.3)                                    # warm up: plans, the worker's pool
facts["off_share"], _ = host_bound(0.6)
facts["off_stats"] = C.spin_throttle_stats()
time.sleep(0.1)
C.set_spin_throttle("auto")
s0 = C.spin_throttle_stats()
facts["auto_share"], out = host_bound(0.6)
s1 = C.spin_throttle_stats()
facts["engaged"] = s1["engaged"] - s0["engaged"]
facts["held_during"] = s1["held"]
facts["starved_windows"] = s1["windows_starved"] - s0["windows_starved"]
a = torch.randn(1 << 20)
facts["sum_equal"] = torch.equal(a.to("neuron").sum().cpu(), a.sum())  # a reduction while throttled
time.sleep(0.3)                                    # idle > 20 ms: the worker ends its pool, the throttle goes
s2 = C.spin_throttle_stats()
facts["held_after_idle"] = s2["held"]
facts["released"] = s2["released"] - s0["released"]
emit(facts)
""",
        check,
    )


def test_a_device_the_host_runs_ahead_of_keeps_its_spinning_helper() -> None:
    def check(facts: dict[str, Any]) -> None:
        assert facts["windows"] >= 20 and facts["ahead"] >= facts["windows"] // 2, facts
        assert facts["host_blocked"] >= facts["windows"] // 2, facts  # the host waited in its syncs
        assert facts["engaged"] == 0, facts
        assert facts["value"] is True
        assert facts["held_host_bound"] is True, facts
        assert facts["released_busy"] == 1 and facts["held_ahead"] is False, facts
        assert "'auto', 'on' or 'off'" in facts["bad_mode"]

    _in_fresh_processes(
        _THROTTLE_CHILD
        + """
x = torch.randn(1024, 1024, device="neuron")
for _ in range(3):
    (x + 1)
torch.neuron.synchronize()
s0 = C.spin_throttle_stats()
t0 = time.perf_counter()
while time.perf_counter() - t0 < 0.5:             # the host runs ahead: hundreds of kernels queued
    for _ in range(400):
        y = x + 1
    torch.neuron.synchronize()
s1 = C.spin_throttle_stats()
facts = {"engaged": s1["engaged"] - s0["engaged"], "windows": s1["windows"] - s0["windows"],
         "ahead": s1["windows_ahead"] - s0["windows_ahead"], "value": torch.equal(y.cpu(), x.cpu() + 1),
         "host_blocked": s1["windows_host_blocked"] - s0["windows_host_blocked"]}
# a host-bound loop engages; the host then running ahead gives it back while the device is still busy
host_bound(0.3)
s2 = C.spin_throttle_stats()
facts["held_host_bound"] = s2["held"]
t0 = time.perf_counter()
while time.perf_counter() - t0 < 0.5:
    for _ in range(2000):                          # past the 1024-launch queue: the host waits for room
        y = x + 1
    torch.neuron.synchronize()
s3 = C.spin_throttle_stats()
facts["released_busy"] = s3["released"] - s2["released"]
facts["held_ahead"] = s3["held"]
try:
    C.set_spin_throttle("sometimes")
    facts["bad_mode"] = None
except ValueError as e:
    facts["bad_mode"] = str(e)
emit(facts)
""",
        check,
    )


def test_a_host_that_keeps_the_queue_deep_without_waiting_keeps_the_throttle() -> None:
    # A compiled step's host (guards, AOT wrappers, an eager optimizer) runs Python while a graph's kernels
    # sit queued >= 128 deep, and never waits: a deep queue alone released the throttle, and the helper's spin
    # took back the core that Python runs on (compiled qwen2/t5/nn_transformer zoo steps 15-25% slower). Here:
    # bursts of 300 adds, each followed by host Python lasting as long as the device takes for the burst
    # (adapted from the waits at the syncs and the device's idling, with the throttle forced on, then measured
    # in auto: the same on any machine).
    def check(facts: dict[str, Any]) -> None:
        assert facts["held_before"] is True, facts
        assert facts["windows"] >= 20, facts
        assert facts["ahead"] >= 6, facts                          # measured 10-15 of 24-35 windows
        assert facts["host_blocked"] <= facts["windows"] // 4, facts  # measured 1-4
        assert facts["held"] is True and facts["released"] == 0, facts
        assert facts["value"] is True

    _in_fresh_processes(
        _THROTTLE_CHILD
        + """
x = torch.randn(256, 1024, device="neuron")     # a burst ~30 ms: its noise (+-15%) stays well under 20 ms
def burst():
    global done
    for _ in range(300):
        y = x + 1
    done = torch.neuron.Event()
    done.record()
    return y
def steps(seconds, spin):
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        y = burst()
        t1 = time.perf_counter()
        while time.perf_counter() - t1 < spin:      # host Python, the device busy with the burst
            pass
        if done.query():                            # the device idled (< 20 ms): a little shorter
            spin *= 0.98
        else:                                       # the host waited: longer, by a margin
            t2 = time.perf_counter()
            torch.neuron.synchronize()
            spin += time.perf_counter() - t2 + 0.03 * spin
    return y, spin
spin = 0.0
for _ in range(3):  # set-up: a device timing jump can idle the worker 20 ms, which gives the throttle back
    C.set_spin_throttle("auto")
    host_bound(0.3)                                # engages it
    C.set_spin_throttle("on")                      # held while the host's Python is timed to the device's
    _, spin = steps(0.4, spin)
    C.set_spin_throttle("auto")
    s0 = C.spin_throttle_stats()
    if s0["held"]:
        break
y, _ = steps(0.6, spin)
s1 = C.spin_throttle_stats()
facts = {"held_before": s0["held"], "held": s1["held"], "released": s1["released"] - s0["released"],
         "windows": s1["windows"] - s0["windows"], "ahead": s1["windows_ahead"] - s0["windows_ahead"],
         "host_blocked": s1["windows_host_blocked"] - s0["windows_host_blocked"],
         "value": torch.equal(y.cpu(), x.cpu() + 1)}
emit(facts)
""",
        check,
    )


def test_set_num_threads_and_flush_denormal_reach_the_device_after_it_ran() -> None:
    # Both are per-thread state in ATen: a worker that had run a parallel kernel kept its first thread count
    # (a 3M-element sum stopped being CPU's after torch.set_num_threads), and its flush-denormal mode.
    facts = run_child(
        """
import torch
import torchneuron_lab  # noqa: F401

torch.manual_seed(0)
v = torch.randn(3_000_001)
vn = v.to("neuron")
facts = {"sums": []}
for n in (2, 1, 3, 2, 3, 1):
    torch.set_num_threads(n)
    c = v.sum()
    d = vn.sum()
    e = vn.sum()                               # the second launch of the plan: queued, on the worker
    facts["sums"].append([n, c.item(), d.item(), e.item()])
tiny = torch.tensor([1e-39, 1e-40, 1.0])
tn = tiny.to("neuron")
facts["denormal"] = []
for mode in (True, False, True):
    torch.set_flush_denormal(mode)
    c = (tiny * 1e30).tolist()
    tn * 1e30
    d = (tn * 1e30).tolist()                   # queued
    facts["denormal"].append([mode, c, d])
torch.set_flush_denormal(False)
facts["wrapped"] = torch.set_num_threads.__name__
emit(facts)
""",
        outcomes=True,
    )
    for n, cpu, first, queued in facts["sums"]:
        assert first == cpu and queued == cpu, (n, cpu, first, queued)
    assert len({cpu for _, cpu, _, _ in facts["sums"]}) >= 2  # the thread count does change CPU's sum
    for mode, cpu, dev in facts["denormal"]:
        assert dev == cpu, (mode, cpu, dev)
        assert (cpu[0] == 0.0) == mode
    assert facts["wrapped"] == "set_num_threads"
