"""torch.distributed on neuron: the ``neuron`` process-group backend (torchneuron_lab/distributed).

Every test runs real processes on this machine (a ``file://`` rendezvous, Gloo over 127.0.0.1), each rank a
fresh interpreter with one deadline for all (tests/_neuron_child.py, ``run_ranks``): a hang or a crash fails the
test and leaves no process behind. Results are compared with the same program on CPU tensors in a Gloo group,
which is the transport the backend uses: equal bit for bit.
"""

from __future__ import annotations

import re

import pytest
from _neuron_child import run_child, run_ranks

COLLECTIVES = """
import json, os, warnings
warnings.simplefilter("ignore")
import torch, torchneuron_lab  # noqa: F401
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev = os.environ["DEV"]
dist.init_process_group("neuron" if dev == "neuron" else "gloo", init_method="file://" + os.environ["INIT_FILE"],
                        rank=rank, world_size=world)
g = torch.Generator().manual_seed(rank)
def data(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(dev)
out = {}
def keep(name, *ts):
    out[name] = [t.cpu().tolist() for t in ts]
    out[name + " devices"] = sorted({t.device.type for t in ts})

for op in ("SUM", "MAX", "MIN", "PRODUCT", "AVG"):
    x = data(33); dist.all_reduce(x, op=getattr(dist.ReduceOp, op)); keep("all_reduce " + op, x)
x = data(7, dtype=torch.int64); dist.all_reduce(x); keep("all_reduce int64", x)
try:  # refused by both ranks (Gloo's error, at the call): the collectives after it still pair up
    dist.all_reduce(data(3), op=dist.ReduceOp.BAND); out["refused BAND"] = None
except RuntimeError as e:
    out["refused BAND"] = str(e).splitlines()[0]
z = torch.view_as_complex(data(4, 2)); dist.reduce(z, dst=0); keep("reduce complex", torch.view_as_real(z))
o = torch.view_as_complex(torch.empty(3, 2, device=dev))
dist.reduce_scatter_tensor(o, torch.view_as_complex(data(3 * world, 2)))
keep("reduce_scatter_tensor complex", torch.view_as_real(o))
x = data(5, 3).t(); x = x.contiguous(); dist.all_reduce(x); keep("all_reduce 2-D", x)
x = data(9); dist.broadcast(x, src=1); keep("broadcast", x)
x = data(9); dist.reduce(x, dst=0); keep("reduce", x)
outs = [torch.empty(4, device=dev) for _ in range(world)]; dist.all_gather(outs, data(4)); keep("all_gather", *outs)
o = torch.empty(world * 6, device=dev); dist.all_gather_into_tensor(o, data(6)); keep("all_gather_into_tensor", o)
for op in ("SUM", "AVG"):
    o = torch.empty(5, device=dev); dist.reduce_scatter_tensor(o, data(5 * world), op=getattr(dist.ReduceOp, op))
    keep("reduce_scatter_tensor " + op, o)
o = torch.empty(3, device=dev); dist.reduce_scatter(o, [data(3) for _ in range(world)]); keep("reduce_scatter", o)
gl = [torch.empty(2, device=dev) for _ in range(world)] if rank == 0 else None
dist.gather(data(2), gl, dst=0); keep("gather", *(gl or []))
o = torch.empty(3, device=dev); dist.scatter(o, [data(3) for _ in range(world)] if rank == 0 else None, src=0)
keep("scatter", o)
o = torch.empty(2 * world, device=dev); dist.all_to_all_single(o, data(2 * world)); keep("all_to_all_single", o)
if rank == 0:
    dist.send(data(4), dst=1); r = torch.empty(4, device=dev); dist.recv(r, src=1)
else:
    r = torch.empty(4, device=dev); dist.recv(r, src=0); dist.send(data(4), dst=0)
keep("send/recv", r)
x = data(6); w = dist.all_reduce(x, async_op=True); w.wait(); keep("async all_reduce", x)
fut_value = dist.all_reduce(data(3), async_op=True).get_future().wait()[0]; keep("future value", fut_value)
dist.barrier()
objs = [None] * world; dist.all_gather_object(objs, {"rank": rank}); out["all_gather_object"] = objs
c = torch.full((3,), float(rank + 1)); dist.all_reduce(c); out["cpu tensor"] = c.tolist()
if dev == "neuron":  # NCCL's PREMUL_SUM (Gloo refuses it): each input scaled, then summed
    a = data(8); expect = a.cpu() * 0.25
    dist.all_reduce(a, op=dist._make_nccl_premul_sum(0.25)); out["premul_sum"] = a.cpu().tolist()
    e = torch.tensor(expect.tolist()); dist.all_reduce(e); out["premul_sum expected"] = e.tolist()
    r = data(8); given = r.cpu()
    dist.reduce(r, dst=0, op=dist._make_nccl_premul_sum(0.25)); out["premul reduce"] = r.cpu().tolist()
    e = given * 0.25; dist.all_reduce(e)  # the root gets the sum of the scaled inputs, the others keep theirs
    out["premul reduce expected"] = e.tolist() if rank == 0 else given.tolist()
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_every_collective_on_neuron_tensors_equals_gloo_on_cpu_tensors():
    neuron = run_ranks(COLLECTIVES, env={"DEV": "neuron"})
    cpu = run_ranks(COLLECTIVES, env={"DEV": "cpu"})
    for rank in range(2):
        n, c = neuron[rank], cpu[rank]
        assert n.pop("premul_sum") == n.pop("premul_sum expected")
        assert n.pop("premul reduce") == n.pop("premul reduce expected")
        names = [k for k in c if not k.endswith(" devices")]
        assert len(names) == 25
        for k in names:
            assert n[k] == c[k], (rank, k)
            if k + " devices" in c:
                assert n[k + " devices"] == (["neuron"] if c[k] else []), k
    # the data moved: sums are the two ranks' values, the broadcast is rank 1's, the objects both ranks'
    assert neuron[0]["broadcast"] == neuron[1]["broadcast"]
    assert neuron[0]["all_reduce SUM"] == neuron[1]["all_reduce SUM"]
    assert neuron[0]["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
    assert neuron[0]["cpu tensor"] == [3.0, 3.0, 3.0]
    assert neuron[0]["refused BAND"] == "Cannot use ReduceOp.BAND with non-integral dtype"
    assert neuron[0]["send/recv"] != neuron[1]["send/recv"]


TRAINING = """
import json, os, warnings
warnings.simplefilter("ignore")
import torch, torchneuron_lab  # noqa: F401
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev, kind = os.environ["DEV"], os.environ["KIND"]
dist.init_process_group("neuron" if dev == "neuron" else "gloo", init_method="file://" + os.environ["INIT_FILE"],
                        rank=rank, world_size=world)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
if kind == "ddp":
    model = model.to(dev)
    wrapped = DDP(model, bucket_cap_mb=0.004)  # several buckets: all-reduces launched during backward
else:
    mesh = init_device_mesh(dev, (world,))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    wrapped = fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(100 + rank)
losses = []
for step in range(3):
    x, y = torch.randn(8, 16, generator=g).to(dev), torch.randn(8, 4, generator=g).to(dev)
    loss = torch.nn.functional.mse_loss(wrapped(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
out = {"losses": losses, "params": [p.detach().cpu().flatten().tolist() for p in params],
       "devices": sorted({p.device.type for p in params})}
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_ddp_and_fsdp2_training_on_neuron_equal_cpu_bit_for_bit(kind):
    neuron = run_ranks(TRAINING, env={"DEV": "neuron", "KIND": kind}, timeout=400)
    cpu = run_ranks(TRAINING, env={"DEV": "cpu", "KIND": kind}, timeout=400)
    for rank in range(2):
        assert neuron[rank]["devices"] == ["neuron"]
        assert neuron[rank]["losses"] == cpu[rank]["losses"]
        assert neuron[rank]["params"] == cpu[rank]["params"]
    assert neuron[0]["params"] == neuron[1]["params"]  # the replicas agree
    assert neuron[0]["losses"] != neuron[1]["losses"]  # each rank trained on its own data


ASYNC = """
import json, os, time, warnings
warnings.simplefilter("ignore")
import torch, torchneuron_lab  # noqa: F401
import torch.distributed as dist
from torchneuron_lab.device import recorder
from torchneuron_lab.distributed import collective_stream

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group(init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=world)
x = torch.ones(1024, device="neuron")
dist.all_reduce(x)  # connections made
x.cpu()
dist.barrier()
out = {}
recorder.start(10000, with_stack=True)  # before the head start: its first start imports torch._dynamo (~1 s)
if rank == 1:
    time.sleep(0.8)  # rank 0's all-reduce waits for this one on its stream, not on its host
t0 = time.perf_counter()
dist.all_reduce(x)  # LAUNCH LINE
t1 = time.perf_counter()
y = x * 2  # ordered after the collective on the caller's stream
got = y.cpu()
t2 = time.perf_counter()
recorder.stop()
events = recorder.read().events
coll = [e for e in events if e.name == "collective: all_reduce"]
out["launch_s"], out["wait_s"] = t1 - t0, t2 - t1
out["result"] = sorted(set(got.tolist()))
out["collectives"] = [(e.engine, e.stream, (e.end_ns - e.start_ns) / 1e9, e.bytes_read) for e in coll]
out["comm_stream"] = collective_stream().stream_id
out["default_stream"] = torch.neuron.current_stream().stream_id
out["mul_after"] = [e.start_ns >= coll[0].end_ns for e in events if e.name.startswith("aten::mul")]
out["syncs"] = [(e.name, (e.end_ns - e.start_ns) / 1e9) for e in events if e.kind == "sync"]
out["launch_line"] = [f.line for f in coll[0].stack if f.filename.endswith("rank.py")][-1:]
out["backend"] = str(dist.get_backend_config())
# The work's future, as ProcessGroupNCCL's: completed at the call (the communication stream current), a then()
# callback run at once on a pool stream that waits for the collective on the device; the caller's stream and
# the host wait only where the program waits for the future's value.
dist.barrier()
if rank == 1:
    time.sleep(0.8)
z = torch.ones(8, device="neuron")
t3 = time.perf_counter()
fut = dist.all_reduce(z, async_op=True).get_future()
out["future_done_at_call"] = fut.done()
def callback(f):
    out["callback_stream"] = torch.neuron.current_stream().stream_id
    return f.value()[0] * 3
tripled = fut.then(callback)
out["caller_stream_after_then"] = torch.neuron.current_stream().stream_id
out["caller_stream_result"] = sorted(set((torch.ones(8, device="neuron") + 1).cpu().tolist()))
t4 = time.perf_counter()
out["tripled"] = sorted(set(tripled.wait().cpu().tolist()))
t5 = time.perf_counter()
out["caller_s"], out["future_s"] = t4 - t3, t5 - t3
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_a_collective_is_queued_on_the_communication_stream_and_the_host_does_not_wait():
    r0, r1 = run_ranks(ASYNC)
    assert r0["backend"] == "neuron:neuron"  # the accelerator's default backend, as NCCL is CUDA's
    assert r0["result"] == r1["result"] == [8.0]  # ones, all-reduced twice (2, then 4), times 2
    # rank 0's host returned at once; it waited at .cpu() for rank 1 (0.8 s late)
    assert r0["launch_s"] < 0.3 <= r0["wait_s"], r0
    [(engine, stream, seconds, nbytes)] = r0["collectives"]
    assert (engine, stream, nbytes) == ("dma", r0["comm_stream"], 4096)
    assert stream != r0["default_stream"]
    assert seconds >= 0.3  # on the device's timeline the collective spans the wait for the late rank
    assert r0["mul_after"] == [True]
    assert any(name.startswith("sync") and s >= 0.3 for name, s in r0["syncs"]), r0["syncs"]
    launch_line = ASYNC.splitlines().index("dist.all_reduce(x)  # LAUNCH LINE") + 1
    assert r0["launch_line"] == [launch_line]
    # the future: completed at the call; its callback on a stream of the pool, neither the caller's nor the
    # communication stream; the caller's stream did not wait for the late rank, the future's value did
    assert r0["future_done_at_call"] is True
    assert r0["callback_stream"] not in (r0["default_stream"], r0["comm_stream"])
    assert r0["caller_stream_after_then"] == r0["default_stream"]
    assert r0["caller_stream_result"] == [2.0] and r0["tripled"] == r1["tripled"] == [6.0]
    assert r0["caller_s"] < 0.3 <= r0["future_s"], r0


FAILURE = """
import datetime, json, os, time, warnings
warnings.simplefilter("ignore")
import torch, torchneuron_lab  # noqa: F401
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("neuron", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=3))
x = torch.ones(16, device="neuron")
dist.all_reduce(x); x.cpu()  # connected
if rank == 1:
    if os.environ["HOW"] == "exit":
        print(json.dumps({}), flush=True)
        os._exit(0)  # the peer is gone
    time.sleep(12)  # the peer never joins: the group's timeout bounds the wait
    print(json.dumps({}), flush=True)
    os._exit(0)
t0 = time.perf_counter()
dist.all_reduce(x)  # FAILING LAUNCH
launch = time.perf_counter() - t0
try:
    x.cpu()
    err = None
except RuntimeError as e:
    err = str(e)
out = {"launch_s": launch, "error": err, "waited_s": time.perf_counter() - t0,
       "after": (torch.arange(4., device="neuron") * 2).sum().item()}
print(json.dumps(out), flush=True)
os._exit(0)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["exit", "absent"])
def test_a_failed_collective_is_raised_at_the_next_sync_with_its_launch_line(how):
    r0 = run_ranks(FAILURE, env={"HOW": how}, timeout=120)[0]
    line = FAILURE.splitlines().index("dist.all_reduce(x)  # FAILING LAUNCH") + 1
    assert r0["launch_s"] < 0.5
    assert r0["error"] is not None
    assert "asynchronous error in collective: all_reduce launched at" in r0["error"]
    assert f"rank.py:{line}" in r0["error"]
    assert r0["waited_s"] < 60  # bounded by the group's timeout (3 s), not the default 30 min
    assert r0["after"] == 12.0  # the device stays usable


def test_collective_arguments_are_checked_at_the_call():
    facts = run_child(
        """
        import os, tempfile
        import torch.distributed as dist
        f = os.path.join(tempfile.mkdtemp(), "rdv")
        dist.init_process_group("neuron", init_method="file://" + f, rank=0, world_size=1)
        a, b = torch.ones(2, device="neuron:0"), torch.ones(2, device="neuron:1")
        facts = {
            "two devices": outcome(lambda: dist.all_gather([torch.empty(2, device="neuron:0")], b)),
            "cpu and neuron": outcome(lambda: dist.all_gather([torch.empty(2)], a)),
            "into_tensor size": outcome(lambda: dist.all_gather_into_tensor(torch.empty(3, device="neuron"), a)),
            "scatter size": outcome(lambda: dist.reduce_scatter_tensor(torch.empty(3, device="neuron"), a)),
            "overlapping": outcome(lambda: dist.all_reduce(torch.ones(1, device="neuron").expand(4))),
            "bad root": outcome(lambda: dist.broadcast(a, src=3)),
            "world of one": outcome(lambda: (dist.all_reduce(a), a)[1]),
            "barrier": outcome(lambda: dist.barrier()),
        }
        dist.destroy_process_group()
        emit(facts)
        """,
        outcomes=True,
    )
    assert facts["two devices"]["error"] == "RuntimeError"
    assert "same neuron device (neuron:1 and neuron:0)" in facts["two devices"]["message"]
    assert facts["cpu and neuron"]["error"] == "RuntimeError"
    assert "one device" in facts["cpu and neuron"]["message"]
    assert facts["into_tensor size"]["error"] == "RuntimeError"
    assert "world_size times input tensor size" in facts["into_tensor size"]["message"]
    assert facts["scatter size"]["error"] == "RuntimeError"
    assert "non-overlapping and dense" in facts["overlapping"]["message"]
    assert facts["bad root"]["error"] in ("ValueError", "RuntimeError")
    assert facts["world of one"] == {"value": [1.0, 1.0]}
    assert facts["barrier"] == {"value": None}


REFUSALS = """
import os, tempfile
import torch.distributed as dist
f = os.path.join(tempfile.mkdtemp(), "rdv")
dist.init_process_group("neuron", init_method="file://" + f, rank=0, world_size=1)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.complex32, torch.uint16,
          torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"]
def t(dt, dev, n=4):
    return torch.zeros(n, dtype=dt, device=dev)
REDUCE = {
    "all_reduce": lambda dt, d, op: dist.all_reduce(t(dt, d), op=op),
    "all_reduce_coalesced": lambda dt, d, op: dist.all_reduce_coalesced([t(dt, d)], op=op),
    "reduce": lambda dt, d, op: dist.reduce(t(dt, d), dst=0, op=op),
    "reduce_scatter": lambda dt, d, op: dist.reduce_scatter(t(dt, d), [t(dt, d)], op=op),
    "reduce_scatter_tensor": lambda dt, d, op: dist.reduce_scatter_tensor(t(dt, d), t(dt, d), op=op),
}
MOVE = {
    "broadcast": lambda dt, d: dist.broadcast(t(dt, d), src=0),
    "all_gather": lambda dt, d: dist.all_gather([t(dt, d)], t(dt, d)),
    "all_gather_into_tensor": lambda dt, d: dist.all_gather_into_tensor(t(dt, d), t(dt, d)),
    "gather": lambda dt, d: dist.gather(t(dt, d), [t(dt, d)], dst=0),
    "scatter": lambda dt, d: dist.scatter(t(dt, d), [t(dt, d)], src=0),
    "all_to_all_single": lambda dt, d: dist.all_to_all_single(t(dt, d), t(dt, d)),
    "all_to_all": lambda dt, d: dist.all_to_all([t(dt, d)], [t(dt, d)]),
}
seq = dist.distributed_c10d._get_default_group()._get_backend(torch.device("neuron"))._get_sequence_number_for_group
taken = []  # Gloo sequence numbers (one per Gloo call, with its tag) each neuron call took: 1, or 0 if refused
def run(call, dev):
    # synchronous calls: a "cpu:gloo" work raises in its wait, inside the call; a neuron refusal must too,
    # not as the asynchronous error of the next sync
    def go():
        call(dev)
        if dev == "neuron":
            torch.neuron.synchronize()
    s0 = seq()
    result = outcome(go)
    if dev == "neuron":
        torch.neuron.synchronize()
        taken.append([seq() - s0, "error" in result])
    return result
facts = {}
for dt in DTYPES:
    for name, fn in REDUCE.items():
        for op in OPS:
            call = lambda d, fn=fn, dt=dt, op=op: fn(dt, d, getattr(dist.ReduceOp, op))
            facts[f"{name} {op} {dt}"] = [run(call, "cpu"), run(call, "neuron")]
    for name, fn in MOVE.items():
        call = lambda d, fn=fn, dt=dt: fn(dt, d)
        facts[f"{name} {dt}"] = [run(call, "cpu"), run(call, "neuron")]
# arguments Gloo checks when its method is called (list lengths, sizes, types): at the call on neuron too
def T(d, *shape, dt=torch.float32):
    return torch.zeros(*shape, dtype=dt, device=d)
MALFORMED = {
    "all_gather 2 outputs": lambda d: dist.all_gather([T(d, 4), T(d, 4)], T(d, 4)),
    "all_gather 0 outputs": lambda d: dist.all_gather([], T(d, 4)),
    "all_gather size": lambda d: dist.all_gather([T(d, 5)], T(d, 4)),
    "all_gather_into_tensor dtype": lambda d: dist.all_gather_into_tensor(T(d, 4, dt=torch.float64), T(d, 4)),
    "gather 2": lambda d: dist.gather(T(d, 4), [T(d, 4), T(d, 4)], dst=0),
    "gather size": lambda d: dist.gather(T(d, 4), [T(d, 5)], dst=0),
    "scatter 2": lambda d: dist.scatter(T(d, 4), [T(d, 4), T(d, 4)], src=0),
    "scatter size": lambda d: dist.scatter(T(d, 4), [T(d, 5)], src=0),
    "reduce_scatter 2": lambda d: dist.reduce_scatter(T(d, 4), [T(d, 4), T(d, 4)]),
    "reduce_scatter_tensor dtype": lambda d: dist.reduce_scatter_tensor(T(d, 4), T(d, 4, dt=torch.int64)),
    "all_to_all_single splits": lambda d: dist.all_to_all_single(T(d, 4), T(d, 4), [3], [4]),
    "all_to_all_single split count": lambda d: dist.all_to_all_single(T(d, 4), T(d, 4), [4, 0], [4, 0]),
    "all_to_all 2": lambda d: dist.all_to_all([T(d, 4), T(d, 4)], [T(d, 4), T(d, 4)]),
    "all_to_all size": lambda d: dist.all_to_all([T(d, 5)], [T(d, 4)]),
    "all_gather_coalesced size": lambda d: dist.all_gather_coalesced([[T(d, 5)]], [T(d, 4)]),
    "all_gather_coalesced": lambda d: dist.all_gather_coalesced([[T(d, 4)]], [T(d, 4)]),
    "all_to_all_single sizes": lambda d: dist.all_to_all_single(T(d, 5), T(d, 4)),
    "recv from itself": lambda d: dist.recv(T(d, 4), src=0),
}
for name, call in MALFORMED.items():
    facts[f"malformed {name}"] = [run(call, "cpu"), run(call, "neuron")]
# NCCL's PREMUL_SUM, composed by the backend (a cpu:gloo group refuses it): floating tensors, else NCCL's error
for dt in DTYPES:
    for name in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
        def premul(name=name, dt=dt):
            x = torch.arange(4, device="neuron").to(dt)
            o = x if name in ("all_reduce", "reduce") else torch.empty_like(x)
            if name == "reduce_scatter":
                dist.reduce_scatter(o, [x], op=dist._make_nccl_premul_sum(2.0))
            elif name == "reduce_scatter_tensor":
                dist.reduce_scatter_tensor(o, x, op=dist._make_nccl_premul_sum(2.0))
            elif name == "reduce":
                dist.reduce(x, dst=0, op=dist._make_nccl_premul_sum(2.0))
            else:
                dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.0))
            return torch.view_as_real(o).tolist() if o.is_complex() else o.float().tolist()
        facts[f"premul {name} {dt}"] = outcome(premul)
facts["taken"] = taken
x = torch.ones(3, device="neuron")
dist.all_reduce(x)  # the group is usable after every refusal
facts["after"] = x.tolist()
dist.destroy_process_group()
emit(facts)
"""


def test_gloos_refusals_of_a_dtype_or_reduce_op_are_raised_at_the_call_with_its_message():
    facts = run_child(REFUSALS, outcomes=True, timeout=300)
    assert facts.pop("after") == [1.0, 1.0, 1.0]
    # a neuron call that ran took one Gloo tag, as a cpu:gloo call does; a refused one took none: the checks at
    # the call take no tag (the ranks' tags stay paired, whatever each rank's checks did)
    taken = facts.pop("taken")
    assert sorted({(n, refused) for n, refused in taken}) == [(0, True), (1, False)]
    assert sum(not refused for _, refused in taken) > 300
    premul = {k: facts.pop(k) for k in list(facts) if k.startswith("premul ")}
    # without split sizes, Gloo's own enforce names its source file; the backend's message names the sizes
    itself = facts.pop("malformed recv from itself")  # Gloo: an enforce naming its source file, at the call
    assert itself[0]["error"] == itself[1]["error"] == "RuntimeError" and "CONNECTED" in itself[0]["message"]
    assert itself[1]["message"] == "recv: rank 0 cannot receive from itself"
    sizes = facts.pop("malformed all_to_all_single sizes")
    assert sizes[0]["error"] == sizes[1]["error"] == "RuntimeError" and "in->size" in sizes[0]["message"]
    assert sizes[1]["message"].startswith("all_to_all_single: the input and output tensors must have the same number")
    # Gloo's message spells the op as its enum's byte; the backend's names it
    for key, (cpu, _) in facts.items():
        if "on complex tensors" in cpu.get("message", ""):
            cpu["message"] = re.sub(r"support[\x00-\x1f]on", f"support {key.split()[1]} on", cpu["message"])
    # AVG of complex32: Gloo divides the complex tensor in place, and ATen's CPU kernels have no ComplexHalf
    # division; the backend averages its float16 view, as NCCL does on CUDA
    gap = "not implemented for 'ComplexHalf'"
    cpu_gap = {k for k, (cpu, _) in facts.items() if gap in cpu.get("message", "")}
    assert cpu_gap == {f"{n} AVG torch.complex32" for n in ("reduce", "reduce_scatter", "reduce_scatter_tensor")}
    assert all(facts[k][1] == {"value": None} for k in cpu_gap)
    differ = {k: v for k, v in facts.items() if v[0] != v[1] and k not in cpu_gap}
    assert not differ, f"{len(differ)} of {len(facts)} differ from a cpu:gloo group's outcome: {differ}"
    for k, v in premul.items():
        dt = k.split()[-1]
        if dt in ("torch.float32", "torch.float64", "torch.float16", "torch.bfloat16"):
            assert v == {"value": [0.0, 2.0, 4.0, 6.0]}, k
        elif dt in ("torch.complex64", "torch.complex128", "torch.complex32"):
            assert v == {"value": [[0.0, 0.0], [2.0, 0.0], [4.0, 0.0], [6.0, 0.0]]}, k
        elif dt in ("torch.int8", "torch.uint8", "torch.int32", "torch.int64", "torch.bool"):
            assert v == {"error": "TypeError", "message": "PreMulSum Data type must be half, float, bfloat16 or double"}, k
        else:
            assert v == {"error": "RuntimeError", "message": "Invalid scalar type"}, k
    refused = [k for k, (cpu, _) in facts.items() if "error" in cpu]
    # the classes: a dtype Gloo lacks, bitwise ops on floating dtypes, AVG on integral ones
    assert "all_gather torch.int16" in refused and "reduce PRODUCT torch.complex64" in refused
    assert facts["all_reduce BAND torch.float32"][1] == {
        "error": "RuntimeError", "message": "Cannot use ReduceOp.BAND with non-integral dtype"}
    assert facts["all_reduce AVG torch.int64"][1] == {
        "error": "RuntimeError", "message": "result type Float can't be cast to the desired output type Long"}
    assert facts["broadcast torch.uint16"][1] == {"error": "RuntimeError", "message": "Invalid scalar type"}
    assert facts["all_reduce SUM torch.bfloat16"][1] == {"value": None}
    assert 100 < len(refused) < len(facts)
    malformed = [k for k in facts if k.startswith("malformed ")]
    assert len(malformed) == 16 and sum("error" in facts[k][0] for k in malformed) == 15
    assert facts["malformed gather 2"][1]["message"].startswith("ProcessGroupGloo::gather: Incorrect output list size 2")


@pytest.fixture(scope="module")
def ip():
    from IPython.testing.globalipapp import get_ipython
    from IPython.utils.capture import capture_output

    shell = get_ipython()
    with capture_output():
        shell.run_line_magic("load_ext", "torchneuron_lab")
    yield shell
    with capture_output():
        shell.run_line_magic("unload_ext", "torchneuron_lab")
    shell.user_ns.pop("_neuron_ranks", None)


def _rank_processes(under: str = "") -> list[str]:
    """The rank processes running now (``under``: only those whose script is in that folder)."""
    import subprocess

    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if "tnl-ranks-" in line and "rank.py" in line and under in line]


@pytest.mark.timeout(300)
def test_neuron_ranks_magic_runs_the_cell_as_the_ranks_of_a_job(ip, tmp_path, monkeypatch):
    import tempfile

    from IPython.utils.capture import capture_output

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this test's ranks only (another run's are not)
    mine = str(tmp_path)

    with capture_output() as cap:
        r = ip.run_cell(
            "%%neuron_ranks -n 2 -t 200\n"
            "x = torch.full((3,), float(rank + 1), device='neuron')\n"
            "dist.all_reduce(x)\n"
            "print('rank', rank, 'of', world_size, x.cpu().tolist(), dist.get_backend())\n",
            store_history=True)
    assert r.error_in_exec is None, cap.stdout
    res = ip.user_ns["_neuron_ranks"]
    assert res.ok and res.world_size == 2
    assert [o.returncode for o in res.ranks] == [0, 0]
    assert [o.stdout.strip() for o in res.ranks] == [f"rank {k} of 2 [3.0, 3.0, 3.0] neuron" for k in (0, 1)]
    assert len(cap.outputs) == 1 and "-- rank 1 (exit 0" in cap.outputs[0].data["text/plain"]  # displayed once
    assert "rank 1 of 2 [3.0, 3.0, 3.0] neuron" in res._repr_html_()
    assert _rank_processes(mine) == []


@pytest.mark.timeout(300)
def test_neuron_ranks_magic_fails_the_cell_names_the_failing_rank_and_kills_the_rest(ip, tmp_path, monkeypatch):
    import tempfile

    from IPython.utils.capture import capture_output

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this test's ranks only (another run's are not)
    mine = str(tmp_path)

    with capture_output():
        r = ip.run_cell(
            "%%neuron_ranks -n 2 -t 200\n"
            "import time\n"
            "if rank == 1:\n"
            "    raise ValueError('boom on rank 1')\n"
            "time.sleep(150)  # rank 0 would wait: it is killed as soon as rank 1 failed\n",
            store_history=True)
    assert isinstance(r.error_in_exec, RuntimeError)
    assert "rank 1 exited with 1: ValueError: boom on rank 1" in str(r.error_in_exec)
    res = ip.user_ns["_neuron_ranks"]
    assert res.ranks[0].returncode is None and res.ranks[0].seconds < 60  # killed, not waited for
    assert 'File "cell [' in res.ranks[1].stderr  # the traceback names the cell
    assert _rank_processes(mine) == []
    # the deadline: every rank killed, the cell fails and says so
    with capture_output():
        r = ip.run_cell("%%neuron_ranks -n 2 -t 6\nimport time\ntime.sleep(120)\n", store_history=True)
    assert "did not finish in time" in str(r.error_in_exec)
    assert [o.returncode for o in ip.user_ns["_neuron_ranks"].ranks] == [None, None]
    assert _rank_processes(mine) == []
    # bad arguments: the usage line, before anything runs
    with capture_output():
        r = ip.run_cell("%%neuron_ranks -n 0\npass\n", store_history=True)
    assert "-n must be >= 1" in str(r.error_in_exec) and "%neuron_ranks [-n NPROC]" in str(r.error_in_exec)


@pytest.mark.timeout(300)
def test_ctrl_c_while_the_ranks_run_kills_every_rank(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from _neuron_child import ROOT, child_env

    driver = tmp_path / "driver.py"
    driver.write_text(
        "import faulthandler, signal, sys\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view of a hang\n"
        # What the driver inherited, for a hang's report: a SIGINT ignored (SIG_IGN in the test process when it
        # was spawned: Python then installs no KeyboardInterrupt handler) or blocked (a signal mask is inherited
        # too). The 2026-12-07 hang's stacks showed the driver still polling 60 s after the SIGINT, no exception
        # raised. A notebook's kernel delivers Ctrl-C as KeyboardInterrupt: the driver asks for the same.
        "print('inherited SIGINT', signal.getsignal(signal.SIGINT), 'blocked',\n"
        "      sorted(int(x) for x in signal.pthread_sigmask(signal.SIG_BLOCK, [])), file=sys.stderr, flush=True)\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])\n"
        "import json, time\n"
        "from torchneuron_lab.distributed.launch import run_ranks\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    run_ranks('import time\\nprint(\"started\", flush=True)\\ntime.sleep(200)\\n', 2, timeout=250)\n"
        "    print(json.dumps({'interrupted': False}))\n"
        "except KeyboardInterrupt:\n"
        "    print(json.dumps({'interrupted': True, 'seconds': time.monotonic() - t0}))\n")
    # (its ranks' scripts in this test's folder: another test run's ranks on the machine are not counted)
    proc = subprocess.Popen([sys.executable, str(driver)], cwd=ROOT, env=child_env({"TMPDIR": str(tmp_path)}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    mine = str(tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_rank_processes(mine)) < 2:
            time.sleep(0.2)
        assert len(_rank_processes(mine)) == 2
        time.sleep(3)  # the ranks are in the user's code
        os.kill(proc.pid, signal.SIGINT)  # Ctrl-C in the waiting notebook
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # every thread's stack to its stderr, then fail with them
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"the driver did not exit 60 s after Ctrl-C; stdout {out!r}; its stacks:\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        subprocess.run(["pkill", "-9", "-f", mine + "/tnl-ranks-"], check=False)  # (ranks have their own sessions)
    facts = json.loads(out.strip().splitlines()[-1])
    assert facts["interrupted"] is True, err
    assert _rank_processes(mine) == []


ORDER = """
import datetime, json, os, time, warnings
warnings.simplefilter("ignore")
import torch, torchneuron_lab  # noqa: F401
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("neuron", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
out = {}
def busy(device):  # keeps the caller's stream busy, so a collective launched now runs later
    a = torch.randn(384, 384, device=device)
    for _ in range(30 if rank == 1 else 1):
        a = (a @ a).tanh()
    return a

# a CPU collective (and an object collective) after a queued neuron one: Gloo calls in program order
busy("neuron")
x = torch.full((4,), 10.0 * (rank + 1), device="neuron")
dist.all_reduce(x)
c = torch.full((4,), 1000.0 * (rank + 1))
dist.all_reduce(c)
objs = [None] * world
dist.all_gather_object(objs, {"rank": rank})
out["neuron then cpu"] = [x.cpu().tolist(), c.tolist(), objs]

# one group used from two devices of a process
busy("neuron:1")
a = torch.full((4,), 1.0 * (rank + 1), device="neuron:1")
dist.all_reduce(a)
b = torch.full((4,), 10.0 * (rank + 1), device="neuron:0")
dist.all_reduce(b)
out["two devices"] = [a.cpu().tolist(), b.cpu().tolist()]

# both ranks send before they receive: isend/irecv and batch_isend_irecv
peer = 1 - rank
s, r = torch.full((4,), rank + 1.0, device="neuron"), torch.zeros(4, device="neuron")
works = [dist.isend(s, peer), dist.irecv(r, peer)]
for w in works:
    w.wait()
out["isend/irecv"] = r.cpu().tolist()
r2 = torch.zeros(4, device="neuron")
for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, s * 2, peer), dist.P2POp(dist.irecv, r2, peer)]):
    w.wait()
out["batch_isend_irecv"] = r2.cpu().tolist()

# Work.wait(timeout): the host waits at most that long, then "Operation timed out!" (as Gloo)
dist.barrier()
if rank == 1:
    time.sleep(4)
t0 = time.perf_counter()
w = dist.barrier(async_op=True)
try:
    w.wait(timeout=datetime.timedelta(seconds=1))
    out["wait timeout"] = ["returned", time.perf_counter() - t0]
except RuntimeError as e:
    out["wait timeout"] = [str(e), time.perf_counter() - t0]
    w.wait()  # then it completes
dist.barrier()
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_collectives_keep_program_order_across_cpu_tensors_devices_and_point_to_point():
    r0, r1 = run_ranks(ORDER, timeout=240)
    for r in (r0, r1):
        assert r["neuron then cpu"] == [[30.0] * 4, [3000.0] * 4, [{"rank": 0}, {"rank": 1}]]
        assert r["two devices"] == [[3.0] * 4, [30.0] * 4]
    assert (r0["isend/irecv"], r1["isend/irecv"]) == ([2.0] * 4, [1.0] * 4)
    assert (r0["batch_isend_irecv"], r1["batch_isend_irecv"]) == ([4.0] * 4, [2.0] * 4)
    message, seconds = r0["wait timeout"]
    assert message == "Operation timed out!" and 0.9 <= seconds < 3.5


RECV_ANY = """
import json, os, warnings
warnings.simplefilter("ignore")
import torch, torchneuron_lab  # noqa: F401
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("neuron", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=world)
got = []
for device in ("neuron", "cpu"):
    if rank == 0:
        for _ in range(world - 1):
            t = torch.zeros(3, device=device)
            src = dist.recv(t)  # from any source: the sender's rank is returned
            got.append([src, t.cpu().tolist()])
    else:
        dist.send(torch.full((3,), float(rank), device=device), dst=0)
dist.barrier()
print(json.dumps(sorted(got)))
"""


@pytest.mark.timeout(300)
def test_receive_from_any_source_returns_the_sender():
    facts = run_ranks(RECV_ANY, world_size=3, timeout=200)
    assert facts[0] == [[1, [1.0] * 3], [1, [1.0] * 3], [2, [2.0] * 3], [2, [2.0] * 3]]
