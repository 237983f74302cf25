"""Issue 10, "Hangs and lost data across threads and processes", and issue 11's fork item.

Classes closed:
- locks across fork(): pthread_atfork handlers take every allocator lock before fork() and release them
  in both processes, so no child inherits a lock held by a thread that does not exist there; a child
  forked after the device was initialised gets CUDA's "Cannot re-initialize ... in forked subprocess"
  error when it touches the device (freeing inherited tensors stays safe);
- sending device memory to another process: neuron tensors and storages cannot be shared (their memory is
  private host memory), so every pickling path (queues, pipes, spawn arguments) raises a RuntimeError in
  the caller naming neuron and suggesting .cpu(); a DataLoader worker's error reaches the main process;
- generators shared with the CPU one: neuron dropout draws from the device generator passed explicitly.
"""

from __future__ import annotations

from tests._neuron_child import run_child

FORK_WHILE_ALLOCATING = """
import os, threading, time
held = [torch.ones(1000, device="neuron") for _ in range(4)]
stop = threading.Event()
def churn():
    while not stop.is_set():
        xs = [torch.empty(n, device="neuron") for n in (10, 3000, 300000)]
        del xs
t = threading.Thread(target=churn); t.start()
results = []
for i in range(30):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            torch.ones(2, device="neuron")
            code = 3  # the device must refuse
        except RuntimeError as e:
            code = 0 if str(e).startswith("Cannot re-initialize neuron in forked subprocess") else 4
        try:
            torch.neuron.init()
            code = code or 5
        except RuntimeError:
            pass
        if not torch.neuron._is_in_bad_fork():
            code = code or 6
        del held[:]  # freeing inherited device tensors must not block
        os._exit(code)
    deadline = time.monotonic() + 20
    status = None
    while time.monotonic() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(st)
            break
        time.sleep(0.01)
    if status is None:
        os.kill(pid, 9); os.waitpid(pid, 0)
        status = "hung"
    results.append(status)
stop.set(); t.join()
emit({"results": results, "parent_in_bad_fork": torch.neuron._is_in_bad_fork(),
      "parent_still_works": (torch.ones(3, device="neuron") * 2).tolist()})
"""


def test_fork_while_another_thread_allocates_never_deadlocks() -> None:
    facts = run_child(FORK_WHILE_ALLOCATING, timeout=400, outcomes=True)
    assert facts["results"] == [0] * 30
    assert facts["parent_in_bad_fork"] is False
    assert facts["parent_still_works"] == [2.0, 2.0, 2.0]


FORK_BEFORE_USE = """
import os
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    try:
        value = (torch.arange(3.0, device="neuron") + 1).tolist()
        msg = json.dumps({"value": value, "bad_fork": torch.neuron._is_in_bad_fork()})
    except Exception as e:
        msg = json.dumps({"error": str(e)})
    os.write(w, msg.encode()); os._exit(0)
os.close(w)
child = json.loads(os.read(r, 4096).decode())
os.waitpid(pid, 0)
torch.neuron.init()
emit({"child": child, "initialized": torch.neuron.is_initialized()})
"""


def test_a_child_forked_before_first_use_may_use_the_device() -> None:
    facts = run_child(FORK_BEFORE_USE, outcomes=True)
    assert facts["child"] == {"value": [1.0, 2.0, 3.0], "bad_fork": False}
    assert facts["initialized"] is True


SHARING = """
import multiprocessing as mp
import torch.multiprocessing as tmp
x = torch.arange(4.0, device="neuron")
q = tmp.Queue()
facts = {
    "queue_put": outcome(lambda: q.put(x)),
    "queue_put_nested": outcome(lambda: q.put({"batch": [1, (x, "label")]})),
    "simple_queue_put": outcome(lambda: tmp.get_context("fork").SimpleQueue().put(x)),
    "pickle_storage": outcome(lambda: mp.reduction.ForkingPickler.dumps(x.untyped_storage())),
    "pickle_parameter": outcome(lambda: mp.reduction.ForkingPickler.dumps(torch.nn.Parameter(x))),
    # behind something only multiprocessing's pickler reduces (a socket): the plain pickler that looked for
    # neuron tensors stopped there, put() returned, and the error came from the feeder thread
    "queue_put_behind_a_socket": outcome(lambda: q.put((__import__("socket").socket(), x))),
    "queue_put_in_a_partial": outcome(lambda: q.put(__import__("functools").partial(print, x))),
}
q.put(torch.arange(3.0))  # CPU tensors still travel
facts["cpu_round_trip"] = q.get(timeout=30).tolist()
facts["pickle_to_disk_still_fine"] = outcome(lambda: __import__("pickle").loads(__import__("pickle").dumps(x)).tolist())
emit(facts)
"""

SHARING_ERROR = (
    "neuron tensors cannot be sent to another process: the emulated NeuronCore's memory belongs to the "
    "process that allocated it (there is no inter-process handle like CUDA IPC). Move the tensor to the "
    "CPU first (tensor.cpu()) and back to neuron in the receiving process."
)


def test_sending_a_neuron_tensor_to_another_process_fails_in_the_caller() -> None:
    facts = run_child(SHARING, outcomes=True)
    for name in ("queue_put", "queue_put_nested", "simple_queue_put", "pickle_storage", "pickle_parameter",
                 "queue_put_behind_a_socket", "queue_put_in_a_partial"):
        assert facts[name] == {"error": "RuntimeError", "message": SHARING_ERROR}, name
    assert facts["cpu_round_trip"] == [0.0, 1.0, 2.0]
    assert facts["pickle_to_disk_still_fine"] == {"value": [0.0, 1.0, 2.0, 3.0]}


EXECUTOR = """
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

def ident(v):
    return v

x = torch.arange(4.0, device="neuron")
with ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as ex:
    fut = ex.submit(ident, x)
    facts = {"submit": outcome(lambda: fut.result(timeout=60))}
    facts["next_job"] = outcome(lambda: ex.submit(ident, 7).result(timeout=60))
    facts["cpu_tensor"] = outcome(lambda: ex.submit(ident, torch.arange(3.0)).result(timeout=60))
    facts["map"] = outcome(lambda: list(ex.map(ident, [1, x], timeout=60)))
emit(facts)
"""


def test_a_process_pool_future_given_a_neuron_tensor_raises_and_the_pool_lives_on() -> None:
    # The put guard raised inside the executor's manager thread: the thread died, the future never resolved
    # and every later job of the pool hung. The pool's queue reports pickling errors to the future itself.
    facts = run_child(EXECUTOR, timeout=240, outcomes=True)
    assert facts["submit"] == {"error": "RuntimeError", "message": SHARING_ERROR}
    assert facts["next_job"] == {"value": 7}
    assert facts["cpu_tensor"] == {"value": [0.0, 1.0, 2.0]}
    assert facts["map"] == {"error": "RuntimeError", "message": SHARING_ERROR}


DATALOADER = """
import time
from torch.utils.data import DataLoader, Dataset

class MakesNeuron(Dataset):
    def __len__(self): return 8
    def __getitem__(self, i): return torch.full((2,), float(i), device="neuron")

class HoldsNeuron(Dataset):
    def __init__(self): self.data = [torch.full((2,), float(i), device="neuron") for i in range(8)]
    def __len__(self): return 8
    def __getitem__(self, i): return self.data[i]

class Cpu(Dataset):
    def __len__(self): return 4
    def __getitem__(self, i): return torch.full((2,), float(i))

def first(ds, **kw):
    start = time.monotonic()
    try:
        next(iter(DataLoader(ds, num_workers=2, multiprocessing_context="fork", **kw)))
        return {"value": "no error", "seconds": time.monotonic() - start}
    except Exception as e:
        text = str(e)
        return {"error": type(e).__name__, "seconds": time.monotonic() - start,
                "sharing": "neuron tensors cannot be sent to another process" in text,
                "bad_fork": "Cannot re-initialize neuron in forked subprocess" in text}

facts = {"made_in_unused_parent": first(MakesNeuron(), batch_size=None)}
facts["held_by_parent"] = first(HoldsNeuron(), batch_size=None)
facts["made_after_parent_used"] = first(MakesNeuron(), batch_size=2)
facts["cpu_dataset_after_parent_used"] = [b.tolist() for b in DataLoader(Cpu(), batch_size=2, num_workers=2, multiprocessing_context="fork")]
emit(facts)
"""


def test_dataloader_workers_returning_neuron_tensors_fail_promptly_with_the_reason() -> None:
    facts = run_child(DATALOADER, timeout=300, outcomes=True)
    made = facts["made_in_unused_parent"]
    assert made["error"] == "RuntimeError" and made["sharing"] is True and made["seconds"] < 60
    held = facts["held_by_parent"]
    assert held["error"] == "RuntimeError" and held["sharing"] is True and held["seconds"] < 60
    after = facts["made_after_parent_used"]
    assert after["error"] == "RuntimeError" and after["bad_fork"] is True and after["seconds"] < 60
    assert facts["cpu_dataset_after_parent_used"] == [[[0.0, 0.0], [1.0, 1.0]], [[2.0, 2.0], [3.0, 3.0]]]


RNG_THREADS = """
import threading
import torch.nn.functional as F

def neuron_dropouts():
    torch.neuron.manual_seed(123)
    x = torch.ones(64, device="neuron")
    return [F.dropout(x, 0.5).tolist() for _ in range(200)]

def cpu_draws():
    torch.manual_seed(7)
    return [torch.rand(8).tolist() for _ in range(400)]

def with_noise(main, noise):
    stop = threading.Event()
    def loop():
        while not stop.is_set():
            noise()
    t = threading.Thread(target=loop); t.start()
    try:
        return main()
    finally:
        stop.set(); t.join()

alone_n, alone_c = neuron_dropouts(), cpu_draws()
noisy_n = with_noise(neuron_dropouts, lambda: torch.rand(256))
noisy_c = with_noise(cpu_draws, lambda: F.dropout(torch.ones(256, device="neuron"), 0.5))
torch.manual_seed(123)
cpu_equivalent = F.dropout(torch.ones(64), 0.5).tolist()
emit({"neuron_differs": sum(a != b for a, b in zip(alone_n, noisy_n)),
      "cpu_differs": sum(a != b for a, b in zip(alone_c, noisy_c)),
      "n": [len(noisy_n), len(noisy_c)],
      "first_equals_cpu_from_same_seed": alone_n[0] == cpu_equivalent})
"""


def test_neuron_generator_is_independent_of_cpu_draws_in_other_threads() -> None:
    facts = run_child(RNG_THREADS, timeout=300, outcomes=True)
    assert facts["n"] == [200, 400]
    assert facts["neuron_differs"] == 0
    assert facts["cpu_differs"] == 0
    assert facts["first_equals_cpu_from_same_seed"] is True
