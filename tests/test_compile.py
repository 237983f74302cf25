"""``torch.compile(backend="neuron")`` through its public surface, asserting on data.

Graph breaks (``torch._dynamo.graph_break()`` and a data-dependent ``if``) counted exactly and located
by line (line numbers read from this file with ``inspect``); a recompile from a shape change with
Dynamo's guard-failure text; compiled training matching eager losses; compiled inference matching
eager for a transformer block; every field of the subgraph registry's records; compiled kernels in the
kernel recorder and their buffers in the memory statistics; ops left to ATen reported as fallbacks; the
eager signature cache.

Each test starts from a reset Dynamo with automatic dynamic shapes off (a test that wants dynamic
shapes turns them on itself), so compiles and recompiles are exactly the ones the test causes.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torchneuron_lab  # noqa: F401  (registers the device)
from tests._neuron_child import run_child
from torchneuron_lab.compiler import (
    ExplainReport,
    SubgraphRecord,
    capture,
    explain,
    list_subgraphs,
    registry,
    signatures,
)
from torchneuron_lab.device.recorder import record

REL = 1e-5
tnm: Any = torch.neuron  # type: ignore[attr-defined]  # added at run time by the device registration


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield
    torch._dynamo.reset()


def line_of(fn: Callable[..., Any], needle: str) -> int:
    """Line number (in this file) of the only line of ``fn``'s source containing ``needle``."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, text in enumerate(lines) if needle in text]
    assert len(hits) == 1, f"{needle!r} found {len(hits)} times in {fn.__name__}"
    return hits[0]


def new_records(before: int) -> list[SubgraphRecord]:
    return registry.records()[before:]


def breaks_at(line: int) -> int:
    """How many graph breaks the ambient capture has counted at ``line`` of this file."""
    return sum(b.count for b in capture.graph_breaks() if b.filename == __file__ and b.line == line)


# ---------------------------------------------------------------------------------------------------
# functions under test (their line numbers are looked up, never hard-coded)


def with_break(x: torch.Tensor) -> torch.Tensor:
    y = x.sin() + 1
    torch._dynamo.graph_break()
    return y.cos() * 2


def with_two_breaks(x: torch.Tensor) -> torch.Tensor:
    y = x.sin() + 1
    torch._dynamo.graph_break()  # first
    y = y.cos() * 2
    torch._dynamo.graph_break()  # second
    return y.exp() - 1


def data_dependent(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    if y.sum() > 0:
        return y + 1
    return y - 1


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def mlp_loss(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w1)
    out = h @ w2
    return out.square().mean()


def mm_relu_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = (x @ w).relu() + 1
    return h.sum(-1) * 2


def with_aten_fallbacks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values, indices = torch.topk(x.sin(), 3, dim=-1)
    ordered, _ = torch.sort(x, dim=-1)
    return values * 2, indices, ordered


def neuron(*shape: int, requires_grad: bool = False, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to("neuron").requires_grad_(requires_grad)


# ---------------------------------------------------------------------------------------------------
# backend registration


def test_backend_is_registered_under_its_name() -> None:
    assert "neuron" in torch._dynamo.list_backends(exclude_tags=())


def test_backend_found_through_entry_point_in_fresh_interpreter() -> None:
    # No import of torchneuron_lab.compiler: Dynamo finds "neuron" through the torch_dynamo_backends
    # entry point and the backend registers everything it needs on first use.
    facts = run_child(
        """
        import json, sys, torch
        x = torch.arange(6.0).reshape(2, 3).to("neuron")
        out = torch.compile(lambda t: t.sin() * 2 + 1, backend="neuron", fullgraph=True)(x)
        from torchneuron_lab.compiler import list_subgraphs
        recs = list_subgraphs()
        print(json.dumps({
            "device": str(out.device),
            "close": bool(torch.allclose(out.cpu(), x.cpu().sin() * 2 + 1)),
            "kinds": [r.kind for r in recs],
            "calls": [r.calls for r in recs],
        }))
        """,
        timeout=300,
    )
    assert facts == {"device": "neuron:0", "close": True, "kinds": ["inference"], "calls": [1]}


@pytest.mark.parametrize("inductor_first", [False, True])
def test_aotinductor_refuses_a_neuron_graph_naming_what_to_do(inductor_first: bool) -> None:
    # torch._inductor imported after the device (an import hook wraps aot_compile) or before it (wrapped at once);
    # it failed with InductorError: KeyError: 'neuron'
    facts = run_child(
        """
        FIRST
        import json, sys, torch, torchneuron_lab
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones(4))
            def forward(self, x):
                return x.sin() * self.w
        class ToDevice(torch.nn.Module):
            def forward(self, x):
                return x.to("neuron").sin()
        out = {}
        for name, mod, x in (("parameters and input", M().to("neuron"), torch.randn(4, device="neuron")),
                             ("a value in the graph", ToDevice(), torch.randn(4))):
            ep = torch.export.export(mod, (x,))
            import torch._inductor
            try:
                torch._inductor.aoti_compile_and_package(ep)
            except Exception as e:
                out[name] = [type(e).__name__, str(e).split(":")[0]]
        out["hook_left"] = sum(type(f).__name__ == "_AfterImport" for f in sys.meta_path)
        print(json.dumps(out))
        """.replace("FIRST", "import torch._inductor" if inductor_first else "pass"),
        timeout=300,
    )
    msg = "AOTInductor (torch._inductor.aot_compile / aoti_compile_and_package) does not generate code for the neuron device"
    assert facts == {"parameters and input": ["NotImplementedError", msg],
                     "a value in the graph": ["NotImplementedError", msg], "hook_left": 0}


# ---------------------------------------------------------------------------------------------------
# graph breaks


def test_explicit_graph_break_counted_and_located_by_explain() -> None:
    x = neuron(8, 4)
    line = line_of(with_break, "torch._dynamo.graph_break()")
    rep = explain(with_break, x)
    assert isinstance(rep, ExplainReport)
    assert rep.break_count == 1
    assert rep.graph_count == 2
    assert len(rep.graph_breaks) == 1
    b = rep.graph_breaks[0]
    assert (b.filename, b.line, b.count) == (__file__, line, 1)
    assert b.location == f"{__file__}:{line}"
    assert "torch._dynamo.graph_break()" in b.reason
    assert b.explanation.startswith("User-inserted graph break")
    assert b.hints == ["Remove the `torch._dynamo.graph_break()` call."]
    # the graph before the break is the compile the break happened in; the other resumes after it
    assert [g.kind for g in rep.graphs] == ["inference", "inference"]
    before, after = rep.graphs
    assert before.compile_id == b.compile_id
    assert after.compile_id != b.compile_id
    assert before.function == "with_break"
    assert after.function == f"with_break (after the break at line {line})"
    assert [s["line"] for s in before.source] == [line - 1]
    assert [s["line"] for s in after.source] == [line + 1]
    torch.testing.assert_close(rep.output.cpu(), with_break(x).cpu())
    assert f"break at {__file__}:{line}" in str(rep)
    assert rep.as_dict()["break_count"] == 1 and rep.as_dict()["graph_count"] == 2


def test_two_graph_breaks_counted_exactly() -> None:
    first = line_of(with_two_breaks, "# first")
    second = line_of(with_two_breaks, "# second")
    rep = explain(with_two_breaks, neuron(5))
    assert rep.break_count == 2
    assert rep.graph_count == 3
    assert sorted(b.line for b in rep.graph_breaks) == [first, second]
    assert all(b.count == 1 for b in rep.graph_breaks)
    assert rep.ops_per_graph() == {g.id: 2 for g in rep.graphs}  # sin+add, cos+mul, exp+sub


def test_data_dependent_branch_counted_and_located() -> None:
    line = line_of(data_dependent, "if y.sum() > 0:")
    x = neuron(6, 3)
    rep = explain(data_dependent, x)
    assert rep.break_count == 1
    assert rep.graph_count == 2
    (b,) = rep.graph_breaks
    assert (b.filename, b.line) == (__file__, line)
    assert b.reason == "Data-dependent branching"
    assert "data-dependent branching" in b.explanation
    assert any("torch.cond" in h for h in b.hints)
    torch.testing.assert_close(rep.output.cpu(), data_dependent(x).cpu())


def test_graph_breaks_captured_without_explain_and_counted_once_per_compile() -> None:
    line = line_of(data_dependent, "if y.sum() > 0:")
    before = breaks_at(line)
    fn = torch.compile(data_dependent, backend="neuron")
    pos, neg = neuron(4).abs() + 1, -(neuron(4).abs() + 1)
    for _ in range(3):  # compiled once: the break is seen once
        torch.testing.assert_close(fn(pos).cpu(), data_dependent(pos).cpu())
    assert breaks_at(line) - before == 1
    # the other branch resumes in code Dynamo has not compiled yet, the break itself is not re-traced
    torch.testing.assert_close(fn(neg).cpu(), data_dependent(neg).cpu())
    assert breaks_at(line) - before == 1


@pytest.mark.parametrize("fn", [with_break, data_dependent], ids=["graph_break", "data_dependent"])
@pytest.mark.parametrize("how", ["torch.compile", "explain"])
def test_graph_break_names_the_function_that_broke(fn: Callable[..., Any], how: str) -> None:
    # The break happens in ``fn``; the record must not name the outermost frame of Dynamo's user
    # traceback (the caller below, or explain()).
    def caller() -> list[Any]:
        if how == "explain":
            return explain(fn, neuron(4)).graph_breaks
        torch.compile(fn, backend="neuron")(neuron(4))
        return capture.graph_breaks()

    capture.clear()
    (b,) = caller()
    assert b.line > inspect.getsourcelines(fn)[1]
    assert b.function == fn.__name__


# ---------------------------------------------------------------------------------------------------
# recompiles


def test_recompile_on_shape_change_reports_the_failed_guard() -> None:
    n_rec, n_reg = len(capture.recompiles()), len(registry.records())
    fn = torch.compile(affine, backend="neuron")
    a, b = neuron(8), neuron(16)
    fn(a)
    fn(b)
    fn(a)  # both graphs are cached now: no further recompile
    fn(b)
    recompiles = capture.recompiles()[n_rec:]
    assert len(recompiles) == 1
    r = recompiles[0]
    assert r.function == "affine"
    assert (r.filename, r.line) == (__file__, inspect.getsourcelines(affine)[1])
    assert len(r.failures) == 1
    assert "tensor 'x' size mismatch at index 0. expected 8, actual 16" in r.failures[0]
    recs = new_records(n_reg)
    assert [rec.kind for rec in recs] == ["inference", "inference"]
    assert [rec.inputs[0]["shape"] for rec in recs] == [["8"], ["16"]]
    assert recs[1].compile_id == r.compile_id
    frame0, n0 = recs[0].compile_id.split("/")
    frame1, n1 = recs[1].compile_id.split("/")
    assert (frame0, int(n1) - int(n0)) == (frame1, 1)
    assert [rec.calls for rec in recs] == [2, 2]


def test_recompile_with_automatic_dynamic_shapes_marks_the_dynamic_dim() -> None:
    n_reg = len(registry.records())
    with torch._dynamo.config.patch(automatic_dynamic_shapes=True):
        fn = torch.compile(affine, backend="neuron")
        for n in (8, 16, 24):
            torch.testing.assert_close(fn(neuron(n, 3)).cpu(), affine(neuron(n, 3)).cpu())
    recs = new_records(n_reg)
    assert len(recs) == 2  # static for 8, then one dynamic graph serves 16 and 24
    assert recs[0].inputs[0]["dynamic_dims"] == []
    tensor_inputs = [i for i in recs[1].inputs if i["device"] is not None]
    assert [i["dynamic_dims"] for i in tensor_inputs] == [[0]]
    assert tensor_inputs[0]["shape"][1] == "3"
    assert recs[1].calls == 2


# ---------------------------------------------------------------------------------------------------
# training and inference numerics


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def _optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, foreach=False)


def _train(model: torch.nn.Module, opt_name: str, mode: str) -> tuple[list[float], torch.nn.Module]:
    """Five steps on neuron; ``mode`` eager, ``loss`` (compiled loss, fullgraph) or ``step`` (compiled step)."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(5)]
    m = copy.deepcopy(model).to("neuron")
    opt = _optimizer(opt_name, list(m.parameters()))

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x), y)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(x, y)
        loss.backward()
        return loss

    if mode == "loss":
        loss_fn = torch.compile(loss_fn, backend="neuron", fullgraph=True)  # type: ignore[assignment]
    run = torch.compile(step, backend="neuron") if mode == "step" else step
    losses = []
    for x, y in data:
        loss = run(x.to("neuron"), y.to("neuron"))
        opt.step()
        losses.append(loss.item())
    return losses, m


@pytest.mark.parametrize(
    ("opt_name", "mode"),
    [("sgd", "loss"), ("adamw", "loss"), ("adamw", "step")],
    ids=["sgd", "adamw", "adamw-step"],
)
def test_compiled_training_matches_eager_losses(opt_name: str, mode: str) -> None:
    model = _mlp()
    eager, m_eager = _train(model, opt_name, "eager")
    n_reg = len(registry.records())
    compiled, m_comp = _train(model, opt_name, mode)
    rel = [abs(e - c) / abs(e) for e, c in zip(eager, compiled)]
    assert max(rel) <= REL, f"per-step relative differences {rel}\neager    {eager}\ncompiled {compiled}"
    for pe, pc in zip(m_eager.parameters(), m_comp.parameters()):
        torch.testing.assert_close(pc.detach().cpu(), pe.detach().cpu(), rtol=1e-5, atol=1e-6)
    recs = new_records(n_reg)
    fwd = [r for r in recs if r.kind == "forward"]
    bwd = [r for r in recs if r.kind == "backward"]
    assert len(fwd) == len(bwd) == 1, [r.name for r in recs]
    assert fwd[0].pair_id == bwd[0].id and bwd[0].pair_id == fwd[0].id
    assert fwd[0].calls == bwd[0].calls == 5
    if mode == "step":  # zero_grad and backward() break the graph; the graph runs after the first break
        assert fwd[0].function.startswith("step (after the break at line ")


def _encoder_layer() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(
        d_model=64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True
    ).eval()


@pytest.fixture
def mha_fastpath() -> Iterator[Callable[[bool], None]]:
    prev = torch.backends.mha.get_fastpath_enabled()
    yield torch.backends.mha.set_fastpath_enabled
    torch.backends.mha.set_fastpath_enabled(prev)


@pytest.mark.parametrize("variant", ["fastpath", "no_fastpath", "grad"])
def test_transformer_block_inference_matches_eager(
    variant: str, mha_fastpath: Callable[[bool], None]
) -> None:
    # eval + no_grad takes PyTorch's fast path: one fused ATen op that the lowering leaves to ATen.
    # Without the fast path (or with grad on) the layer is traced op by op and lowered to fused kernels.
    mha_fastpath(variant == "fastpath")
    layer = _encoder_layer()
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    m = copy.deepcopy(layer).to("neuron")
    xn = x.to("neuron")
    n_reg = len(registry.records())
    with torch.set_grad_enabled(variant == "grad"):
        ref = m(xn).detach().cpu()
        out = torch.compile(m, backend="neuron", fullgraph=True)(xn).detach().cpu()
        cpu = layer(x).detach()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, cpu, rtol=1e-4, atol=1e-4)
    (rec,) = new_records(n_reg)
    assert rec.kind == ("forward" if variant == "grad" else "inference")
    assert rec.function == "TransformerEncoderLayer.forward"
    if variant == "fastpath":
        assert rec.fallbacks == ["aten::_transformer_encoder_layer_fwd.default"]
        assert [(k["name"], k["kind"]) for k in rec.kernels] == [
            ("aten::_transformer_encoder_layer_fwd.default", "aten-fallback")
        ]
    else:
        # attention takes the CPU's fused choice (flash attention for CPU), as on the CPU device:
        # one ATen kernel instead of bmm/softmax/bmm
        assert "aten::_scaled_dot_product_flash_attention_for_cpu.default" in rec.fallbacks
        assert "aten::mm" in rec.fallbacks
        assert "aten::bmm" not in rec.fallbacks
        assert sum(k["kind"] == "fused" for k in rec.kernels) >= 3


# ---------------------------------------------------------------------------------------------------
# the subgraph registry


@pytest.fixture
def mlp_pair() -> tuple[SubgraphRecord, SubgraphRecord, Callable[[], None]]:
    """Forward and backward records of ``mlp_loss`` after one compiled training call; and a re-runner."""
    x, w1, w2 = (
        neuron(8, 16, seed=1),
        neuron(16, 32, requires_grad=True, seed=2),
        neuron(32, 4, requires_grad=True, seed=3),
    )
    fn = torch.compile(mlp_loss, backend="neuron", fullgraph=True)
    n_reg = len(registry.records())

    def run() -> None:
        fn(x, w1, w2).backward()

    run()
    recs = new_records(n_reg)
    assert [r.kind for r in recs] == ["forward", "backward"]
    return recs[0], recs[1], run


def test_record_pairs_forward_and_backward(mlp_pair: Any) -> None:
    fwd, bwd, _ = mlp_pair
    assert bwd.id == fwd.id + 1
    assert (fwd.pair_id, bwd.pair_id) == (bwd.id, fwd.id)
    assert fwd.graph_key == bwd.graph_key
    assert fwd.compile_id == bwd.compile_id
    assert (fwd.function, bwd.function) == ("mlp_loss", "mlp_loss")
    assert fwd.name == f"forward of mlp_loss (compile {fwd.compile_id})"
    assert bwd.name == f"backward of mlp_loss (compile {fwd.compile_id})"
    assert fwd.device == bwd.device == 0
    assert registry.get(fwd.id) is fwd
    assert list_subgraphs(kind="backward", function="mlp_loss")[-1] is bwd
    assert list_subgraphs(where=lambda r: r.pair_id == fwd.id) == [bwd]


def test_record_source_lines_point_into_this_file(mlp_pair: Any) -> None:
    fwd, bwd, _ = mlp_pair
    expected = [
        (__file__, line_of(mlp_loss, code), "mlp_loss", code)
        for code in ("h = torch.relu(x @ w1)", "out = h @ w2", "return out.square().mean()")
    ]
    for rec in (fwd, bwd):
        assert [(s["filename"], s["line"], s["name"], s["code"]) for s in rec.source] == expected
        assert [s["location"] for s in rec.source] == [f"{__file__}:{e[1]}" for e in expected]


def test_record_graph_code_and_op_counts(mlp_pair: Any) -> None:
    fwd, bwd, _ = mlp_pair
    assert "aten" in fwd.fx_code and "aten" in bwd.fx_code
    assert "torch.ops.aten.mm.default" in fwd.fx_code
    assert fwd.op_counts["aten.mm.default"] == 2
    assert fwd.op_counts["aten.relu.default"] == 1
    assert bwd.op_counts["aten.mm.default"] == 3  # dW2, dH, dW1
    assert fwd.num_ops == sum(fwd.op_counts.values()) > 0
    assert all(isinstance(v, int) and v > 0 for v in bwd.op_counts.values())


def test_record_input_signature(mlp_pair: Any) -> None:
    fwd, bwd, _ = mlp_pair
    assert fwd.inputs == [
        {"shape": ["8", "16"], "dtype": "float32", "device": "neuron:0", "dynamic_dims": []},
        {"shape": ["16", "32"], "dtype": "float32", "device": "neuron:0", "dynamic_dims": []},
        {"shape": ["32", "4"], "dtype": "float32", "device": "neuron:0", "dynamic_dims": []},
    ]
    assert bwd.inputs and all(i["device"] == "neuron:0" and i["dtype"] == "float32" for i in bwd.inputs)
    assert {
        "shape": [],
        "dtype": "float32",
        "device": "neuron:0",
        "dynamic_dims": [],
    } in bwd.inputs  # grad_out


def test_record_guards_are_readable(mlp_pair: Any) -> None:
    fwd, _, _ = mlp_pair
    tensor_match = [g for g in fwd.guards if g.startswith("TENSOR_MATCH")]
    assert len(tensor_match) == 3
    for name, size in (("x", "[8, 16]"), ("w1", "[16, 32]"), ("w2", "[32, 4]")):
        (g,) = [g for g in tensor_match if f"L['{name}']" in g]
        assert f"size={size}" in g and "torch.float32" in g and "device=0" in g
        assert f"requires_grad={name != 'x'}" in g
    assert all("+-" not in g for g in fwd.guards)  # the tree drawing is gone


def test_record_compile_times_by_stage(mlp_pair: Any) -> None:
    fwd, bwd, _ = mlp_pair
    for rec in (fwd, bwd):
        assert set(rec.compile_ms) == {"dynamo", "aot_autograd", "lowering"}
        assert rec.compile_ms["lowering"] is not None and rec.compile_ms["lowering"] > 0
    assert fwd.compile_ms["aot_autograd"] is not None and fwd.compile_ms["aot_autograd"] > 0


def test_record_compile_time_of_dynamo_measured_after_dynamo_reset(mlp_pair: Any) -> None:
    # The fixture reset Dynamo before this compile, as torch._dynamo.reset() and explain() do.
    fwd, _, _ = mlp_pair
    assert fwd.compile_ms["dynamo"] is not None and fwd.compile_ms["dynamo"] > 0


def test_record_kernels(mlp_pair: Any) -> None:
    fwd, bwd, _ = mlp_pair
    assert [k["name"] for k in fwd.kernels if k["kind"] == "extern"] == [
        "extern: aten::mm",
        "extern: aten::mm",
    ]
    assert sum(k["kind"] == "extern" for k in bwd.kernels) == 3
    for rec in (fwd, bwd):
        assert rec.kernels
        for k in rec.kernels:
            assert set(k) == {"name", "aten_ops", "kind"}
            assert k["kind"] in ("fused", "extern")
            assert k["name"].startswith("cpp_fused_" if k["kind"] == "fused" else "extern: aten::")
            assert k["aten_ops"] and all(op.startswith("aten.") for op in k["aten_ops"])
        assert rec.fallbacks == ["aten::mm"]
    assert any(k["aten_ops"] == ["aten.relu"] for k in fwd.kernels)


ATEN_OPS = {
    n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")
}


def norm_ce_loss(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = F.layer_norm(torch.relu(x @ w), (w.shape[1],))
    return F.cross_entropy(h, y)


def test_record_kernel_aten_ops_are_real_aten_ops(mlp_pair: Any) -> None:
    # e.g. cpp_fused_threshold_backward_1 fuses aten.threshold_backward (not aten.threshold + aten.backward)
    fn = torch.compile(norm_ce_loss, backend="neuron", fullgraph=True)
    n_reg = len(registry.records())
    fn(neuron(8, 16), neuron(16, 10, requires_grad=True), torch.randint(0, 10, (8,)).to("neuron")).backward()
    recs = [*mlp_pair[:2], *new_records(n_reg)]
    assert len(recs) == 4
    bad = [
        (r.kind, k["name"], op)
        for r in recs
        for k in r.kernels
        for op in k["aten_ops"]
        if op.split(".", 1)[1] not in ATEN_OPS
    ]
    assert bad == []


def test_record_calls_count_exactly(mlp_pair: Any) -> None:
    fwd, bwd, run = mlp_pair
    assert (fwd.calls, bwd.calls) == (1, 1)
    run()
    run()
    assert (fwd.calls, bwd.calls) == (3, 3)
    assert isinstance(fwd.cache_hits, int) and fwd.cache_hits in (0, 1)


def test_registry_export_json_round_trip_and_clear(mlp_pair: Any, tmp_path: Any) -> None:
    fwd, bwd, run = mlp_pair
    text = registry.export_json()
    doc = json.loads(text)
    assert doc == json.loads(json.dumps([r.as_dict() for r in registry.records()]))
    mine = {d["id"]: d for d in doc if d["id"] in (fwd.id, bwd.id)}
    assert mine[fwd.id] == fwd.as_dict()  # plain data: nothing lost on the way through JSON
    assert mine[bwd.id]["pair_id"] == fwd.id
    path = tmp_path / "subgraphs.json"
    assert registry.export_json(str(path)) == path.read_text(encoding="utf-8")
    n = len(registry.records())
    assert registry.clear() == n
    assert registry.records() == [] and list_subgraphs() == [] and json.loads(registry.export_json()) == []
    with pytest.raises(KeyError, match=f"no compiled subgraph with id {fwd.id}"):
        registry.get(fwd.id)
    run()  # compiled code keeps running after clear(); the record object keeps counting
    assert fwd.calls == 2 and registry.records() == []


def test_list_subgraphs_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind must be 'forward', 'backward' or 'inference', got 'fwd'"):
        list_subgraphs(kind="fwd")


def test_record_guards_belong_to_their_own_compile_across_dynamo_resets() -> None:
    # Dynamo's compile ids restart at 0/0 after torch._dynamo.reset() (explain() resets too); the
    # guards of a record not yet read must still be its own.
    n_reg = len(registry.records())
    torch.compile(affine, backend="neuron")(neuron(3, 5))
    torch._dynamo.reset()
    torch.compile(mm_relu_sum, backend="neuron")(neuron(7, 4), neuron(4, 2))
    first, second = new_records(n_reg)
    assert first.compile_id == second.compile_id  # the collision this test is about
    mine = [g for g in first.guards if g.startswith("TENSOR_MATCH")]
    assert len(mine) == 1 and "size=[3, 5]" in mine[0], mine
    assert len([g for g in second.guards if g.startswith("TENSOR_MATCH")]) == 2


# ---------------------------------------------------------------------------------------------------
# compiled kernels in the recorder and in memory statistics


def test_compiled_kernels_are_recorder_events_with_the_subgraph_id() -> None:
    x, w = neuron(64, 128, seed=1), neuron(128, 32, seed=2)
    fn = torch.compile(mm_relu_sum, backend="neuron", fullgraph=True)
    n_reg = len(registry.records())
    fn(x, w)  # compile outside the recording
    (rec,) = new_records(n_reg)
    assert [k["name"] for k in rec.kernels] == ["extern: aten::mm", rec.kernels[1]["name"]]
    fused_name = rec.kernels[1]["name"]
    assert fused_name.startswith("cpp_fused_")
    with record() as box:
        eager = x + 1
        out = fn(x, w)
        out2 = fn(x, w)
    events = box[0].events
    compiled = [e for e in events if e.subgraph == rec.id]
    assert [e.name for e in compiled] == ["extern: aten::mm", fused_name] * 2  # one event per launch
    assert all(e.kind == "kernel" and e.device == 0 and e.end_ns >= e.start_ns for e in compiled)
    mm = compiled[0]
    assert mm.engine == "tensor"
    assert mm.flops == 2 * 64 * 128 * 32
    assert mm.bytes_read == (64 * 128 + 128 * 32) * 4
    assert mm.bytes_written == 64 * 32 * 4
    fused = compiled[1]
    assert fused.bytes_read + fused.bytes_written >= (64 * 32 + 64) * 4
    # eager and compiled kernels side by side in one trace
    eager_events = [e for e in events if e.subgraph == -1 and e.kind == "kernel"]
    assert [e.name for e in eager_events] == ["aten::add.Tensor"]
    assert events.index(eager_events[0]) < events.index(compiled[0])
    assert rec.calls == 3
    torch.testing.assert_close(out.cpu(), mm_relu_sum(x, w).cpu())
    del eager, out2


def test_compiled_buffers_come_from_the_neuron_allocator() -> None:
    x, w = neuron(64, 128, seed=1), neuron(128, 32, seed=2)
    fn = torch.compile(mm_relu_sum, backend="neuron", fullgraph=True)
    fn(x, w)
    tnm.synchronize()
    base = tnm.memory_allocated()
    s0 = tnm.memory_stats()
    out = fn(x, w)
    s1 = tnm.memory_stats()
    delta = {
        k: s1[k] - s0[k] for k in s0 if k.endswith((".allocated", ".freed", ".current")) and ".all." in k
    }
    # buf0 = x @ w (64x32 f32, freed inside the call), buf1 = the (64,) output (rounded to 512 bytes)
    assert delta["allocation.all.allocated"] == 2
    assert delta["allocation.all.freed"] == 1
    assert delta["allocation.all.current"] == 1
    assert delta["allocated_bytes.all.allocated"] == 64 * 32 * 4 + 512
    assert delta["allocated_bytes.all.freed"] == 64 * 32 * 4
    assert delta["requested_bytes.all.current"] == 64 * 4
    assert tnm.memory_allocated() - base == 512
    assert out.device == torch.device("neuron", 0) and out.shape == (64,)
    del out
    assert tnm.memory_allocated() == base


# ---------------------------------------------------------------------------------------------------
# graphs that cannot be fully lowered


def test_ops_left_to_aten_run_and_are_reported_as_fallbacks() -> None:
    x = neuron(8, 16)
    n_reg = len(registry.records())
    rep_out = torch.compile(with_aten_fallbacks, backend="neuron", fullgraph=True)(x)
    ref = with_aten_fallbacks(x)
    for got, want in zip(rep_out, ref):
        assert got.device.type == "neuron"
        torch.testing.assert_close(got.cpu(), want.cpu())
    (rec,) = new_records(n_reg)
    assert rec.fallbacks == ["aten::sort.stable", "aten::topk.default"]
    kinds = {k["name"]: k["kind"] for k in rec.kernels}
    assert kinds["aten::topk.default"] == kinds["aten::sort.stable"] == "aten-fallback"
    assert any(k.startswith("cpp_fused_") for k in kinds)  # the rest is still fused
    assert rec.op_counts["aten.topk.default"] == rec.op_counts["aten.sort.default"] == 1


def test_fallback_ops_show_in_the_recorder_with_the_subgraph_id() -> None:
    # A timeline of a compiled call should have no hole where an op was left to ATen: every entry of
    # the record's kernel list (fused, extern and aten-fallback) is one recorder event per call.
    x = neuron(8, 16)
    fn = torch.compile(with_aten_fallbacks, backend="neuron", fullgraph=True)
    n_reg = len(registry.records())
    fn(x)
    (rec,) = new_records(n_reg)
    with record() as box:
        fn(x)
    names = [e.name for e in box[0].events if e.subgraph == rec.id]
    assert names == [k["name"] for k in rec.kernels]


def test_explain_lists_fallbacks() -> None:
    rep = explain(with_aten_fallbacks, neuron(8, 16))
    assert rep.graph_count == 1 and rep.break_count == 0
    (g,) = rep.graphs
    assert g.fallbacks == ["aten::sort.stable", "aten::topk.default"]
    assert "fallbacks: aten::sort.stable, aten::topk.default" in str(rep)


# ---------------------------------------------------------------------------------------------------
# eager signature cache


def test_changing_shapes_create_new_signatures_every_iteration() -> None:
    xs = [torch.randn(n, 13).to("neuron") for n in (101, 102, 103, 104)]  # shapes no other test uses
    m0 = signatures.mark()
    for x in xs:
        m = signatures.mark()
        (x * 2).sum()
        assert signatures.new_since(m) == {
            0: [
                f"aten::mul.Tensor(float32[{x.shape[0]}, 13])",
                f"aten::sum(float32[{x.shape[0]}, 13])",  # neuron has its own sum (as CUDA): the op called
            ]
        }
    assert len(signatures.new_since(m0)[0]) == 8
    assert signatures.count(0) - m0[0] == 8
    assert signatures.count() == sum(signatures.mark().values())


def test_fixed_shapes_create_no_signatures_after_the_first_iteration() -> None:
    xs = [torch.randn(97, 11).to("neuron") for _ in range(4)]
    m0 = signatures.mark()
    for i, x in enumerate(xs):
        m = signatures.mark()
        (x * 2).sum()
        new = signatures.new_since(m)
        if i == 0:
            assert new == {0: ["aten::mul.Tensor(float32[97, 11])", "aten::sum(float32[97, 11])"]}
        else:
            assert new == {}
    assert signatures.new_since(m0) == {
        0: ["aten::mul.Tensor(float32[97, 11])", "aten::sum(float32[97, 11])"]
    }
    assert signatures.signatures(0)[-2:] == signatures.new_since(m0)[0]


def test_signatures_reject_a_bad_device() -> None:
    with pytest.raises(ValueError, match="device must be an int in"):
        signatures.count(99)


def test_explain_counts_only_its_own_breaks_after_other_compiles() -> None:
    # one site can have a record per Dynamo counter (transformers' `logger.warning_once` in
    # PreTrainedModel.loss_function: "graph_break" x3 then "unimplemented" x1 after a compiled GPT-2 step);
    # explain() keyed its "before" counts without the counter, so the later record's count stood for both and
    # the site's earlier breaks were reported as the explained function's own (2 extra breaks)
    from torchneuron_lab.compiler import capture

    site = {"reason": "logging.Logger method not supported", "filename": "/elsewhere/modeling_utils.py",
            "line": 4778, "location": "modeling_utils.py:4778", "counter_key": "logging.Logger method"}
    planted = [capture.GraphBreak(**site, count=3, counter="graph_break"),
               capture.GraphBreak(**site, count=1, counter="unimplemented")]
    with capture._lock:
        capture._breaks.extend(planted)
    try:
        rep = explain(with_two_breaks, neuron(5))
    finally:
        with capture._lock:
            for b in planted:
                capture._breaks.remove(b)
    assert rep.break_count == 2
    assert {b.filename for b in rep.graph_breaks} == {__file__}


def _breaks_in_a_callee(t: torch.Tensor) -> torch.Tensor:
    t = t.sin()
    torch._dynamo.graph_break()
    return t.cos()


def test_explain_of_a_statement_leaves_no_compiled_code_to_the_users_later_compile() -> None:
    # %neuron_graph_breaks f(x) explains a fresh copy of the statement, but Dynamo compiled f's own frames (and
    # its resume functions) on the way: the user's later torch.compile(f) reused them, compiled nothing, and a
    # profile of that cell reported no graphs and no breaks
    x = neuron(4)

    def statement() -> torch.Tensor:
        return _breaks_in_a_callee(x)

    rep = explain(statement)
    assert rep.break_count >= 1
    n = len(registry.records())
    breaks = sum(b.count for b in capture.graph_breaks())
    out = torch.compile(_breaks_in_a_callee, backend="neuron")(x)
    assert len(registry.records()) - n == 2          # compiled anew: the graph before the break and after it
    assert sum(b.count for b in capture.graph_breaks()) - breaks == 1
    torch.testing.assert_close(out.cpu(), x.cpu().sin().cos())


def test_the_first_compiles_of_several_threads_at_once_find_the_backend() -> None:
    # Dynamo loads an entry point's backend at its first lookup without a lock: two threads registered it twice
    # (AssertionError: duplicate name: neuron) in 5 of 5 runs with 4 threads
    facts = run_child(
        """
        import importlib.metadata, json, threading, time, torch, torchneuron_lab
        load = importlib.metadata.EntryPoint.load
        def slow_load(self):  # a loaded machine's import: the window between Dynamo's check and its registration
            time.sleep(0.5)
            return load(self)
        importlib.metadata.EntryPoint.load = slow_load
        errors, compiled = [], []
        def work(k):
            try:  # the backend is looked up when the wrapper is made
                compiled.append(torch.compile(torch.nn.Linear(2, 2), backend="neuron"))
            except Exception as e:
                errors.append(repr(e))
        ts = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        [t.start() for t in ts]
        [t.join(240) for t in ts]
        m = torch.nn.Linear(2, 2).to("neuron")
        out = torch.compile(m, backend="neuron")(torch.ones(1, 2, device="neuron"))
        print(json.dumps({"errors": errors, "compiled": len(compiled),
                          "same": bool(torch.equal(out.cpu(), m(torch.ones(1, 2, device="neuron")).cpu()))}))
        """,
        timeout=300,
    )
    assert facts == {"errors": [], "compiled": 8, "same": True}
