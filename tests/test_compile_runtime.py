"""The compiled graph's run time on neuron, and what the lab captures around it (issue 11).

* Per-call cost: a compiled graph keeps the CPU aliases of its inputs between calls (``HostPlan``),
  reusing one only while it views the same bytes with the same layout and nothing else holds it; the
  generated wrapper runs its own kernels while the recorder is off, timed stand-ins while it is on.
* Recompiles and guards are captured from Dynamo's own functions, so no logging configuration hides
  them (as graph breaks already are).
"""

from __future__ import annotations

import gc
import inspect
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import torchneuron_lab  # noqa: F401  (registers the device)
from torchneuron_lab.compiler import backend, capture, registry
from torchneuron_lab.device import recorder
from torchneuron_lab.device._backend import lib


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield
    torch._dynamo.reset()


def _new_records(n: int) -> list[registry.SubgraphRecord]:
    return registry.records()[n:]


def _code_of(rec: registry.SubgraphRecord) -> Any:
    """The live ``_NeuronCode`` AOTAutograd calls for ``rec``."""
    (nc,) = [o for o in gc.get_objects() if type(o) is backend._NeuronCode and o.rec is rec]
    return nc


# ---------------------------------------------------------------------------------------------------
# HostPlan: input aliases kept between calls


def test_host_plan_reuses_an_alias_only_for_the_same_bytes_and_layout() -> None:
    C = lib()
    plan = C.HostPlan(0)
    seen: list[int] = []

    def double(args: list[Any]) -> list[Any]:
        (a,) = args
        assert a.device.type == "cpu"
        seen.append(id(a))
        return [a * 2]

    x = torch.arange(6.0).reshape(2, 3).to("neuron")
    for _ in range(3):
        (out,) = plan.run(double, [x])
        assert out.device == x.device and out.cpu().tolist() == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
    assert (plan.made, plan.reused) == (1, 2)
    assert seen[0] == seen[1] == seen[2]
    # another tensor (other bytes): a new alias, the right values
    y = torch.full((2, 3), 5.0).to("neuron")
    (out,) = plan.run(double, [y])
    assert out.cpu().tolist() == [[10.0] * 3] * 2 and (plan.made, plan.reused) == (2, 2)
    # same bytes, other layout (a transposed view): a new alias with the view's strides
    (out,) = plan.run(double, [y.t()])
    assert out.shape == (3, 2) and (plan.made, plan.reused) == (3, 2)
    # back to y: its alias is still one of the two kept for this position
    (out,) = plan.run(double, [y])
    assert (plan.made, plan.reused) == (3, 3)
    # y's bytes written in place between calls: the reused alias sees the new values
    y.add_(1)
    (out,) = plan.run(double, [y])
    assert out.cpu().tolist() == [[12.0] * 3] * 2 and (plan.made, plan.reused) == (3, 4)


def test_host_plan_makes_a_new_alias_when_the_old_one_is_still_held() -> None:
    C = lib()
    plan = C.HostPlan(0)
    kept: list[Any] = []

    def keep(args: list[Any]) -> list[Any]:
        kept.append(args[0])
        return [args[0]]  # the input itself: comes back as the neuron input, not a copy

    x = torch.ones(4).to("neuron")
    (o1,) = plan.run(keep, [x])
    (o2,) = plan.run(keep, [x])
    assert o1 is x and o2 is x
    assert kept[0] is not kept[1]  # the first alias was still referenced: not reused
    assert (plan.made, plan.reused) == (2, 0)


def test_host_plan_rejects_an_input_on_another_device() -> None:
    plan = lib().HostPlan(0)
    with pytest.raises(RuntimeError, match="compiled graph for neuron:0 got an input on neuron:1"):
        plan.run(lambda a: a, [torch.ones(2, device="neuron:1")])


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.gelu(x @ w) * 2).sum()


def test_compiled_graphs_reuse_input_aliases_from_the_second_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # the host path (graphs that cannot be queued: inputs or outputs off the device)
    monkeypatch.setenv("TORCHNEURON_LAB_QUEUE_GRAPHS", "0")
    n = len(registry.records())
    x = torch.randn(8, 16).to("neuron")
    w = torch.randn(16, 16).to("neuron").requires_grad_()
    fn = torch.compile(_step, backend="neuron", fullgraph=True)
    w_cpu = w.detach().cpu().requires_grad_()
    ref = _step(x.cpu(), w_cpu)
    ref.backward()
    counts = []
    for _ in range(8):
        w.grad = None
        loss = fn(x, w)
        loss.backward()
        torch.testing.assert_close(loss.cpu(), ref.detach())
        torch.testing.assert_close(w.grad.cpu(), w_cpu.grad)
        fwd, bwd = _new_records(n)
        counts.append([(p.made, p.reused) for p in (_code_of(fwd).plan, _code_of(bwd).plan)])
    assert (fwd.kind, bwd.kind, fwd.calls, bwd.calls) == ("forward", "backward", 8, 8)
    n_in = [sum(1 for i in rec.inputs if str(i["device"]).startswith("neuron")) for rec in (fwd, bwd)]
    assert n_in[0] == 2 and n_in[1] >= 2
    # forward: x and w never change, so their aliases are made once and reused by every later call
    assert [c[0] for c in counts] == [(2, 2 * k) for k in range(8)]
    # backward: its inputs are the forward's saved tensors, new each step; `loss` keeps the previous
    # step's graph alive while the next forward runs, so they alternate between allocator blocks: with
    # the two most recent aliases kept per input, once the blocks settle every alias is reused
    made = [c[1][0] for c in counts]
    reused = [c[1][1] for c in counts]
    assert made[0] == n_in[1] and made[-4:] == [made[-1]] * 4
    assert [b - a for a, b in zip(reused[-4:], reused[-3:])] == [n_in[1]] * 3


# ---------------------------------------------------------------------------------------------------
# the wrapper's kernels: untouched while the recorder is off, timed while it is on


def test_wrapper_runs_its_own_kernels_while_the_recorder_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHNEURON_LAB_QUEUE_GRAPHS", "0")  # the host path's timed stand-ins
    n = len(registry.records())
    x = torch.randn(32, 32).to("neuron")
    fn = torch.compile(lambda a: (torch.sin(a) @ a).relu() + 1, backend="neuron", fullgraph=True)
    expected = (torch.sin(x.cpu()) @ x.cpu()).relu() + 1
    torch.testing.assert_close(fn(x).cpu(), expected)
    (rec,) = _new_records(n)
    timing = _code_of(rec).timing
    fused = sorted(k for k in timing.timed if k.startswith("cpp_fused_"))
    assert fused and "extern_kernels" in timing.timed
    assert timing.on is False
    for k in timing.timed:  # the module's own objects, no wrapper in the way
        assert timing.gl[k] is timing.raw[k] and not getattr(timing.gl[k], "_tnl_wrapped", False)
    with recorder.record() as box:
        torch.testing.assert_close(fn(x).cpu(), expected)
    assert timing.on is True and all(timing.gl[k] is timing.timed[k] for k in timing.timed)
    names = [e.name for e in box[0].events if e.subgraph == rec.id]
    assert names == [k["name"] for k in rec.kernels]
    assert "extern: aten::mm" in names and len([m for m in names if m.startswith("cpp_fused_")]) == len(fused)
    torch.testing.assert_close(fn(x).cpu(), expected)
    assert timing.on is False and all(timing.gl[k] is timing.raw[k] for k in timing.timed)


# ---------------------------------------------------------------------------------------------------
# recompiles and guards, whatever the logging configuration


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


@pytest.mark.parametrize("kind", ["none", "disable-critical", "torch-logger-off", "set_logs-off"])
def test_recompiles_and_guards_are_captured_whatever_the_logging_configuration(kind: str) -> None:
    torch_lg = logging.getLogger("torch")
    saved = (torch_lg.level, torch_lg.disabled)
    n_rec, n_reg = len(capture.recompiles()), len(registry.records())
    try:
        if kind == "disable-critical":
            logging.disable(logging.CRITICAL)
        elif kind == "torch-logger-off":
            torch_lg.setLevel(logging.CRITICAL)
            torch_lg.disabled = True
        elif kind == "set_logs-off":
            torch._logging.set_logs(recompiles=False, guards=False)
        fn = torch.compile(affine, backend="neuron")
        for n in (8, 16, 8, 16):
            assert fn(torch.ones(n).to("neuron")).cpu().tolist() == [4.0] * n
    finally:
        logging.disable(logging.NOTSET)
        torch_lg.setLevel(saved[0])
        torch_lg.disabled = saved[1]
        if kind == "set_logs-off":
            torch._logging.set_logs()
    (r,) = capture.recompiles()[n_rec:]
    assert r.function == "affine"
    assert (r.filename, r.line) == (__file__, inspect.getsourcelines(affine)[1])
    (failure,) = r.failures  # Dynamo's text: "<compile id of the entry that failed>: <guard failure>"
    assert re.fullmatch(r"\d+/\d+: tensor 'x' size mismatch at index 0\. expected 8, actual 16", failure)
    assert r.message.startswith(f"Recompiling function affine in {__file__}:{r.line}\n")
    assert r.message.endswith(f"triggered by the following guard failure(s):\n    - {failure}")
    recs = _new_records(n_reg)
    assert [rec.calls for rec in recs] == [2, 2] and recs[1].compile_id == r.compile_id
    for rec, size in zip(recs, (8, 16)):
        (tm,) = [g for g in rec.guards if g.startswith("TENSOR_MATCH")]
        assert f"size=[{size}]" in tm and "PrivateUse1" in tm


# ---------------------------------------------------------------------------------------------------
# compiled random ops draw from the neuron generator


def _dropped(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(x, p=0.5, training=True)


def test_neuron_manual_seed_controls_compiled_dropout_and_leaves_the_cpu_stream_alone() -> None:
    x = torch.ones(64, 64)
    fn = torch.compile(_dropped, backend="neuron", fullgraph=True)

    def run(seed: int, cpu_seed: int, device: str = "neuron:0") -> torch.Tensor:
        torch.manual_seed(cpu_seed)  # seeds the CPU and every neuron generator ...
        torch.neuron.default_generators[torch.device(device).index].manual_seed(seed)  # ... then this one
        cpu_state = torch.random.get_rng_state()
        out = fn(x.to(device))
        assert out.device == torch.device(device)
        assert torch.equal(torch.random.get_rng_state(), cpu_state)  # the CPU stream did not move
        return out.cpu()

    a = run(7, 123)
    assert set(a.unique().tolist()) == {0.0, 2.0} and 0.4 < float((a == 0).float().mean()) < 0.6
    assert torch.equal(run(7, 999), a)  # the neuron seed decides, not the CPU's
    assert not torch.equal(run(8, 123), a)
    assert torch.equal(run(7, 5, "neuron:1"), a)  # a graph on neuron:1 draws from neuron:1's generator
    # the neuron generator is the CPU's algorithm (mt19937): Inductor-CPU seeded alike draws the same
    # mask, and successive calls advance the neuron generator as Inductor-CPU's advance the CPU one
    ind = torch.compile(_dropped, backend="inductor", fullgraph=True)
    torch.manual_seed(7)
    ref = [ind(x), ind(x)]
    torch.neuron.manual_seed(7)
    s0 = torch.neuron.get_rng_state()
    got = [fn(x.to("neuron")).cpu(), fn(x.to("neuron")).cpu()]
    assert not torch.equal(torch.neuron.get_rng_state(), s0)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and not torch.equal(got[0], got[1])
