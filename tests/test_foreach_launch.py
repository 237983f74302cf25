"""A `_foreach_*` op is one launch on neuron (as CUDA runs it as one multi-tensor kernel), not one per tensor.

The worker runs the op's own composite loop on CPU views of the device memory, so results are CPU's bit for
bit; whatever the per-tensor path could reject (broadcasting, mixed dtypes, overlap, a scalar that does not fit)
takes that loop on the host as before, with CPU's errors at the call. The sweep runs every foreach OpInfo of the
installed wheel's databases in a subprocess (a crash fails the test, not the run).
"""

from __future__ import annotations

import pytest
import torch

import torchneuron_lab  # noqa: F401  (registers the device)
from torchneuron_lab.device import recorder
from torchneuron_lab.device._backend import lib

from _neuron_child import run_child

C = lib()


def _kernels(fn) -> list[recorder.Event]:  # type: ignore[name-defined]
    torch.neuron.synchronize()
    with recorder.record() as box:
        fn()
        torch.neuron.synchronize()
    return [e for e in box[0].events if e.kind == "kernel"]


def _pair(n: int, *shapes: tuple[int, ...], seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    cpu = [torch.randn(*shapes[i % len(shapes)], generator=g) for i in range(n)]
    return cpu, [t.to("neuron") for t in cpu]


def test_every_eligible_foreach_op_is_registered() -> None:
    # in-place ops of a Tensor[] and functional ones with an in-place twin; reductions keep their loop
    assert C.foreach_launch_ops >= 100
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::_foreach_addcdiv_.ScalarList", "PrivateUse1")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::_foreach_sqrt", "PrivateUse1")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_foreach_norm.Scalar", "PrivateUse1")


def test_an_adamw_step_launches_one_kernel_per_foreach_op_with_cpus_results() -> None:
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    models = {d: __import__("copy").deepcopy(base).to(d) for d in ("cpu", "neuron")}
    opts = {d: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for d, m in models.items()}
    x = torch.randn(8, 16)
    for step in range(4):
        for d in ("cpu", "neuron"):
            opts[d].zero_grad()
            models[d](x.to(d)).square().mean().backward()
        evs = _kernels(opts["neuron"].step)
        opts["cpu"].step()
        names = [e.name for e in evs]
        if step == 0:  # the state's first use: zeros_like per parameter
            names = [n for n in names if n != "aten::zero_"]
        assert all(n.startswith("aten::_foreach_") for n in names), names  # no per-tensor launches
        # AdamW's eight foreach ops (weight decay, lerp_, mul_, addcmul_, sqrt, div_, add_, addcdiv_), each one
        # launch for the 4 parameters together (32 launches before)
        assert len(names) == 8, names
        for a, b in zip(models["cpu"].parameters(), models["neuron"].parameters(), strict=True):
            assert torch.equal(a, b.cpu()), step


def test_a_foreach_launch_records_its_bytes_and_returns_before_it_ran() -> None:
    cpu, dev = _pair(5, (64, 64), (32,))
    other_cpu, other = _pair(5, (64, 64), (32,), seed=1)
    nbytes = sum(t.numel() * 4 for t in cpu)
    torch.neuron.synchronize()
    torch.neuron._sleep(200)
    torch._foreach_add_(dev, other, alpha=0.5)
    enqueued, completed = C.stream_counts(0, 0)
    assert enqueued - completed == 2  # the sleep and the foreach op: the host did not wait
    torch._foreach_add_(cpu, other_cpu, alpha=0.5)
    for a, b in zip(cpu, dev, strict=True):
        assert torch.equal(a, b.cpu())
    (ev,) = _kernels(lambda: torch._foreach_mul_(dev, other))
    assert ev.name.startswith("aten::_foreach_mul_")
    assert (ev.bytes_read, ev.bytes_written) == (2 * nbytes, nbytes)
    assert ev.host_start_ns <= ev.host_end_ns <= ev.start_ns <= ev.end_ns


def test_a_functional_foreach_op_allocates_device_outputs_as_one_launch() -> None:
    cpu, dev = _pair(4, (16, 8), (3,))
    cpu = [t.abs() for t in cpu]
    dev = [t.abs() for t in dev]
    torch.neuron.synchronize()
    before = torch.neuron.memory_allocated()
    same = [torch.empty_like(t) for t in dev]  # what the outputs take, allocated one by one
    expected = torch.neuron.memory_allocated() - before
    del same
    out: list[torch.Tensor] = []
    evs = _kernels(lambda: out.extend(torch._foreach_sqrt(dev)))
    assert [e.name for e in evs] == ["aten::_foreach_sqrt"]
    want = torch._foreach_sqrt(cpu)
    assert [o.device for o in out] == [torch.device("neuron", 0)] * 4
    for a, b in zip(want, out, strict=True):
        assert torch.equal(a, b.cpu()) and a.stride() == b.stride()
    del a, b
    assert torch.neuron.memory_allocated() - before == expected > 0  # each output its own device block
    del out[:]
    assert torch.neuron.memory_allocated() == before


@pytest.mark.parametrize(
    "case",
    ["broadcast", "mixed_dtypes", "partial_overlap", "half_overflow", "int_lists", "two_devices_cpu"],
)
def test_what_one_launch_cannot_take_runs_the_per_tensor_loop_with_cpus_outcome(case: str) -> None:
    # the per-tensor loop on the host: the same result, or CPU's error at the call
    def make(device: str) -> tuple[list[torch.Tensor], list]:
        if case == "broadcast":
            a = [torch.randn(4, 3, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
            return [t.to(device) for t in a], [[torch.ones(3, device=device), torch.ones(1, device=device)]]
        if case == "mixed_dtypes":
            a = [torch.randn(4, 3, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
            return [t.to(device) for t in a], [[torch.ones(4, 3, dtype=torch.float64, device=device)] * 2]
        if case == "partial_overlap":
            base = torch.arange(10.0, device=device)
            return [base[1:9]], [[base[0:8]]]
        if case == "half_overflow":
            return [torch.ones(4, dtype=torch.float16, device=device)], [1e6]
        if case == "int_lists":
            return [torch.arange(6, device=device)], [[torch.arange(6, device=device)]]
        return [torch.ones(3, device=device)], [[torch.ones(3)]]  # a CPU tensor in a neuron list op

    outcomes = []
    for device in ("cpu", "neuron"):
        xs, args = make(device)
        if case == "two_devices_cpu" and device == "cpu":
            outcomes.append("error")  # reference below: neuron must raise CPU/CUDA's device error
            continue
        try:
            torch._foreach_add_(xs, *args)
            torch.neuron.synchronize()
            outcomes.append([t.cpu() for t in xs])
        except RuntimeError as e:
            outcomes.append(type(e).__name__ if case != "two_devices_cpu" else "error")
            msg = str(e)
    if case == "two_devices_cpu":
        assert outcomes == ["error", "error"] and "same device" in msg
    elif isinstance(outcomes[0], str):
        assert outcomes[0] == outcomes[1]
    else:
        for a, b in zip(*outcomes, strict=True):
            assert torch.equal(a, b)
    assert (torch.ones(2, device="neuron") + 1).tolist() == [2.0, 2.0]  # nothing left pending


SWEEP = """
import torch, collections
from torch.testing._internal.common_methods_invocations import (
    foreach_unary_op_db, foreach_binary_op_db, foreach_pointwise_op_db, foreach_reduce_op_db,
    foreach_other_op_db)
from torchneuron_lab.device import recorder

def to(x, d):
    if isinstance(x, torch.Tensor):
        return x.detach().clone().to(d)
    if isinstance(x, (list, tuple)):
        return type(x)(to(y, d) for y in x)
    return x

def run(fn, sample, d):
    inp, args, kw = to(sample.input, d), to(sample.args, d), to(sample.kwargs, d)
    try:
        res = fn(inp, *args, **kw)
        if d == "neuron":
            torch.neuron.synchronize()
    except Exception as e:
        return ("error", type(e).__name__)
    res = inp if res is None else res
    return ("ok", [t.cpu() if isinstance(t, torch.Tensor) else t for t in (res if isinstance(res, (list, tuple)) else [res])])

def same(a, b):
    if a[0] != b[0]:
        return False
    if a[0] == "error":
        return a[1] == b[1]
    return len(a[1]) == len(b[1]) and all(
        (torch.equal(x, y) or (x.is_floating_point() and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True)))
        and x.dtype == y.dtype and x.shape == y.shape for x, y in zip(a[1], b[1]))

stats = collections.Counter()
bad = []
one_launch = collections.Counter()
dbs = foreach_unary_op_db + foreach_binary_op_db + foreach_pointwise_op_db + foreach_reduce_op_db + foreach_other_op_db
for info in dbs:
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        if dtype not in info.dtypes:
            continue
        for variant, fn in (("functional", info.op), ("inplace", info.inplace_variant)):
            if fn is None:
                continue
            for sample in info.sample_inputs("cpu", dtype, num_input_tensors=[3]):
                want = run(fn, sample, "cpu")
                with recorder.record() as box:
                    got = run(fn, sample, "neuron")
                names = [e.name for e in box[0].events if e.kind == "kernel"]
                launched = [n for n in names if n.startswith("aten::_foreach_")]
                stats["samples"] += 1
                if launched:
                    stats["one_launch"] += 1
                    one_launch[info.name + ("_" if variant == "inplace" else "")] += 1
                    if len(names) != 1:
                        bad.append((info.name, variant, str(dtype), "more than one kernel", names[:5]))
                if not same(want, got):
                    bad.append((info.name, variant, str(dtype), str(want)[:120], str(got)[:120]))
emit({"stats": dict(stats), "bad": bad, "one_launch": dict(one_launch)})
"""


def test_foreach_opinfo_samples_match_cpu_and_most_float_ones_are_one_launch() -> None:
    facts = run_child(SWEEP, timeout=900, outcomes=True)
    assert facts["bad"] == []
    stats = facts["stats"]
    assert stats["samples"] > 500
    assert stats["one_launch"] > stats["samples"] // 4, stats
    for op in ("_foreach_add_", "_foreach_mul_", "_foreach_lerp_", "_foreach_addcmul_", "_foreach_addcdiv_",
               "_foreach_div_", "_foreach_sqrt", "_foreach_sqrt_", "_foreach_exp"):
        assert facts["one_launch"].get(op, 0) > 0, op
