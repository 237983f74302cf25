"""Sparse COO tensors on neuron, as CUDA supports them: made on the device (factories, conversions, `.to`,
sparse gradients), every op CPU has for them, results equal to CPU's bit for bit (kernels.cpp, "Sparse COO
tensors"). Run in a child interpreter: the host path for sparse ops is the risky part (member write-back)."""

from __future__ import annotations

import pytest

from tests._neuron_child import run_child

PROGRAM = """
import copy, io

def program(dev):
    torch.manual_seed(0)
    out = {}
    i = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]])  # uncoalesced: (0, 2) twice
    v = torch.tensor([3.0, 4.0, 5.0, 1.0])
    s = torch.sparse_coo_tensor(i, v, (2, 3)).to(dev)
    d = torch.arange(12.0).reshape(3, 4).to(dev)
    out["factory_on_device"] = torch.sparse_coo_tensor(i.to(dev), v.to(dev), (2, 3))
    out["to_sparse"] = torch.eye(3, device=dev).to_sparse()
    out["to_sparse_dim"] = torch.arange(6.0, device=dev).reshape(2, 3).to_sparse(1)
    out["empty_sparse"] = torch.empty(2, 3, layout=torch.sparse_coo, device=dev)
    out["coalesce"] = s.coalesce()
    out["to_dense"] = s.to_dense()
    out["add_"] = s.clone().add_(s)
    t = s.clone().coalesce()
    t.mul_(3)
    out["mul_"] = t
    z = s.clone()
    z.zero_()
    out["zero_"] = z
    r = s.clone()
    r.sparse_resize_((4, 3), 2, 0)
    out["sparse_resize_"] = r
    out["t"] = s.t().coalesce()
    out["dense_plus_sparse"] = d[:2, :3] + s
    out["dense_add_sparse_"] = d[:2, :3].clone().add_(s)
    out["sparse_mm"] = torch.sparse.mm(s, d)
    out["matmul"] = s @ d
    out["addmm"] = torch.sparse.addmm(torch.ones(2, 4, device=dev), s, d)
    out["index_select"] = s.coalesce().index_select(1, torch.tensor([2, 0], device=dev))
    out["sparse_mask"] = d[:2, :3].sparse_mask(s.coalesce())
    out["sum_all"] = s.sum()
    out["sparse_sum_dim"] = torch.sparse.sum(s, 0)
    out["softmax"] = torch.sparse.softmax(s.coalesce(), 1)
    out["log_softmax"] = torch.sparse.log_softmax(s.coalesce(), 1)
    out["neg"] = -s
    out["pow"] = s.coalesce().pow(2)
    out["narrow_copy"] = s.coalesce().narrow_copy(1, 1, 2)
    out["hybrid"] = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, 3), (4, 3)).to(dev) * 2
    out["to_cpu"] = s.cpu()
    buf = io.BytesIO()
    torch.save(s, buf)
    buf.seek(0)
    out["save_load"] = torch.load(buf)
    out["deepcopy"] = copy.deepcopy(s)
    out["members"] = torch.cat([s.coalesce()._indices().flatten().float(), s.coalesce()._values()])
    # autograd: a dense gradient through sparse @ dense, and a gradient of the values
    w = d.clone().requires_grad_(True)
    (torch.sparse.mm(s, w) ** 2).sum().backward()
    out["grad_dense"] = w.grad
    vals = v.to(dev).requires_grad_(True)
    torch.sparse.sum(torch.sparse_coo_tensor(i.to(dev), vals, (2, 3)) * 2).backward()
    out["grad_values"] = vals.grad
    # embeddings with sparse gradients: three steps of each optimizer that takes them
    opts = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
            "sparse_adam": lambda p: torch.optim.SparseAdam(p, lr=0.1)}
    for name, make in opts.items():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True).to(dev)
        opt = make(list(emb.parameters()))
        for _ in range(3):
            opt.zero_grad()
            (emb(torch.tensor([[1, 2, 2], [3, 1, 9]], device=dev)) ** 2).sum().backward()
            opt.step()
        out["embedding_" + name] = emb.weight.detach()
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(10, 3, sparse=True, mode="mean").to(dev)
    bag(torch.tensor([[1, 2], [4, 4]], device=dev)).sum().backward()
    out["embedding_bag_grad"] = bag.weight.grad
    # GradScaler unscales sparse gradients (coalesced, then their values)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True).to(dev)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(dev)
    with torch.autocast(dev, dtype=torch.bfloat16):
        loss = emb(torch.tensor([1, 2, 2], device=dev)).float().pow(2).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    out["grad_scaler"] = emb.weight.detach()
    return out

def same(a, b):
    if a.layout != b.layout or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.layout == torch.sparse_coo:
        return (a.is_coalesced() == b.is_coalesced() and torch.equal(a._indices(), b._indices().cpu())
                and torch.equal(a._values(), b._values().cpu()))
    return torch.equal(a, b.cpu())

cpu, neuron = program("cpu"), program("neuron")
facts = {}
for name in cpu:
    b = neuron[name]
    members = [b] if b.layout != torch.sparse_coo else [b, b._indices(), b._values()]
    facts[name] = {"same": same(cpu[name], b), "layout": str(b.layout), "devices": sorted({str(m.device) for m in members})}
emit(facts)
"""


def test_sparse_coo_programs_on_neuron_equal_cpu_bit_for_bit() -> None:
    facts = run_child(PROGRAM, outcomes=True, timeout=300)
    assert len(facts) == 37
    assert [k for k, f in facts.items() if not f["same"]] == []
    assert {k: f["devices"] for k, f in facts.items() if f["devices"] != ["neuron:0"]} == {"to_cpu": ["cpu"]}
    sparse = sorted(k for k, f in facts.items() if f["layout"] == "torch.sparse_coo")
    assert sparse == sorted(["factory_on_device", "to_sparse", "to_sparse_dim", "empty_sparse", "coalesce", "add_",
                             "mul_", "zero_", "sparse_resize_", "t", "index_select", "sparse_mask", "sparse_sum_dim",
                             "softmax", "log_softmax", "neg", "pow", "narrow_copy", "hybrid", "to_cpu", "save_load",
                             "deepcopy", "embedding_bag_grad"])


ORDER = """
from torchneuron_lab.device import recorder
idx = torch.tensor([[0, 1, 2]], device="neuron")
vals = torch.ones(3, device="neuron")
torch.neuron.synchronize()
recorder.start(1000)
torch.neuron._sleep(200)           # the stream is busy
vals.mul_(5)                       # queued behind the sleep
s = torch.sparse_coo_tensor(idx, vals, (4,))  # made at once: it holds the members, reads nothing
dense = s.to_dense()               # a host kernel: it waits for the stream, then reads the values
twice = dense * 2                  # queued after it
facts = {"dense": twice.cpu().tolist(), "shares_values": s._values().data_ptr() == vals.data_ptr()}
recorder.stop()
events = recorder.read().events
facts["kernels"] = [e.name for e in events if e.kind == "kernel"]
facts["to_dense_after_mul"] = (next(e for e in events if e.name == "aten::_to_dense").start_ns
                               >= next(e for e in events if e.name == "aten::mul_.Tensor").end_ns)
mixed = outcome(lambda: torch.sparse.mm(s.unsqueeze(1).coalesce(), torch.ones(1, 2)))
facts["mixed_devices"] = mixed
facts["compressed_still_refused"] = outcome(lambda: torch.eye(2, device="neuron").to_sparse_csr())["error"]
emit(facts)
"""


def test_sparse_ops_run_in_stream_order_and_refuse_mixed_devices() -> None:
    facts = run_child(ORDER, outcomes=True)
    assert facts["dense"] == [10.0, 10.0, 10.0, 0.0]  # the queued mul_ ran before the host read the values
    assert facts["shares_values"] is True  # a COO tensor holds its members, as on CPU and CUDA
    assert facts["to_dense_after_mul"] is True
    assert facts["kernels"][:2] == ["neuron::_sleep", "aten::mul_.Tensor"] and "aten::_to_dense" in facts["kernels"]
    # (torch.sparse.mm composes addmm on a zeros tensor made on the dense argument's device)
    assert facts["mixed_devices"]["error"] == "RuntimeError"
    assert facts["mixed_devices"]["message"].startswith(
        "Expected all tensors to be on the same device, but found at least two devices, neuron:0 and cpu!")
    assert facts["compressed_still_refused"] == "NotImplementedError"


SWEEP = """
import collections
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_map

def on_neuron(x):
    return x.to("neuron") if isinstance(x, torch.Tensor) else x

def host_form(x):  # what is compared: a COO result's coalesced flag and members, a dense result itself
    if not isinstance(x, torch.Tensor):
        return x
    x = x.cpu()
    return ("coo", x.is_coalesced(), x._indices(), x._values()) if x.layout == torch.sparse_coo else ("dense", x)

def equal(a, b):
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):  # bit for bit (NaNs included)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
    return a == b

counts = collections.Counter()
failures, ops = [], set()
for op in op_db:
    if not op.supports_sparse:
        continue
    for dtype in sorted(op.supported_dtypes("cpu"), key=str):
        try:
            samples = list(op.sample_inputs_sparse(torch.sparse_coo, "cpu", dtype))
        except NotImplementedError:  # no COO sample function: the dense samples' inputs made sparse, as
            # PyTorch's TestSparseUnaryUfuncs makes them
            samples = [s for s in op.sample_inputs("cpu", dtype) if isinstance(s.input, torch.Tensor)]
            for s in samples:
                s.input = s.input.to_sparse()
        except Exception:  # no COO samples for this dtype (on CPU either)
            continue
        for k, s in enumerate(samples):
            ops.add(op.name)
            args = [s.input, *s.args]
            try:
                want = ("value", tree_map(host_form, op(*args, **s.kwargs)))
            except Exception as e:
                want = ("error", type(e).__name__)
            try:
                got = ("value", tree_map(host_form, op(*tree_map(on_neuron, args), **tree_map(on_neuron, s.kwargs))))
            except Exception as e:
                got = ("error", type(e).__name__)
            random = op.name == "randn_like"  # the device's generator is not the CPU's: its layout and shape only
            if want[0] == got[0] == "value" and random:
                ok = tree_map(lambda x: x[:2] + (x[2],) if isinstance(x, tuple) and x[0] == "coo" else 0, want[1]) == \\
                     tree_map(lambda x: x[:2] + (x[2],) if isinstance(x, tuple) and x[0] == "coo" else 0, got[1])
            else:
                ok = want[0] == got[0] and (want[1] == got[1] if want[0] == "error" else equal(want[1], got[1]))
            counts["same error" if ok and want[0] == "error" else "equal" if ok else "different"] += 1
            if not ok:
                failures.append(f"{op.name} {dtype} sample {k}: cpu {want[0]}, neuron {got[0]}")
emit({"counts": dict(counts), "failures": failures[:20], "ops": len(ops)})
"""


@pytest.mark.slow
def test_opinfo_sparse_coo_samples_on_neuron_equal_cpus() -> None:
    """Every COO sample input of every OpInfo that supports sparse inputs (op_db from the installed wheel; for an
    op without COO samples, its dense samples' inputs made sparse), each dtype CPU supports: the op on the samples moved to neuron equals the op on CPU (values, layout, coalesced
    flag and members bit for bit) or raises the same exception type."""
    facts = run_child(SWEEP, outcomes=True, timeout=600)
    assert facts["failures"] == []
    assert facts["counts"].get("different", 0) == 0
    assert facts["ops"] >= 40 and facts["counts"]["equal"] >= 3000, facts
