"""Graph-break capture (issue 9): independent of logging configuration, equal to Dynamo's counters,
compile times that belong to their own compile, and Dynamo's printed warnings kept out of the output.

``torch._dynamo.utils.counters["graph_break"]`` is Dynamo's own count of the breaks it resumed after;
each lab record says under which ``counters[counter][counter_key]`` Dynamo counted it, and the lab's
totals per key equal Dynamo's in every case below.
"""

from __future__ import annotations

import inspect
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import torchneuron_lab  # noqa: F401  (registers the device)
from torchneuron_lab.compiler import capture, registry


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    capture.clear()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield
    torch._dynamo.reset()


def line_of(fn: Callable[..., Any], needle: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, text in enumerate(lines) if needle in text]
    assert len(hits) == 1
    return hits[0]


def with_break(x: torch.Tensor) -> torch.Tensor:
    y = x.sin() + 1
    torch._dynamo.graph_break()
    return y.cos() * 2


def three_breaks(x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):  # a break inside a loop: Dynamo skips this frame, then compiles helper alone
        x = helper(x)
    return x


def helper(x: torch.Tensor) -> torch.Tensor:
    x = x + 1
    torch._dynamo.graph_break()
    return x * 2


def with_item(x: torch.Tensor) -> torch.Tensor:
    return x * x.sum().item()


def lab_counts(counter: str = "graph_break") -> dict[str, int]:
    out: dict[str, int] = {}
    for b in capture.graph_breaks():
        if b.counter == counter:
            out[b.counter_key] = out.get(b.counter_key, 0) + b.count
    return out


def dynamo_counts() -> dict[str, int]:
    return dict(torch._dynamo.utils.counters["graph_break"])


class _LoggingConfig:
    """Logging configurations a user's notebook may set; each undone on exit."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __enter__(self) -> None:
        root = logging.getLogger()
        torch_lg = logging.getLogger("torch")
        self.saved = (root.level, list(root.handlers), torch_lg.level, torch_lg.disabled)
        if self.kind == "disable-warning":
            logging.disable(logging.WARNING)
        elif self.kind == "disable-critical":
            logging.disable(logging.CRITICAL)
        elif self.kind == "basicConfig-error":
            logging.basicConfig(level=logging.ERROR, force=True)
        elif self.kind == "torch-logger-off":
            torch_lg.setLevel(logging.CRITICAL)
            torch_lg.disabled = True
        elif self.kind == "set_logs-off":
            torch._logging.set_logs(graph_breaks=False, recompiles=False)

    def __exit__(self, *exc: object) -> None:
        logging.disable(logging.NOTSET)
        root = logging.getLogger()
        torch_lg = logging.getLogger("torch")
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in self.saved[1]:
            root.addHandler(h)
        root.setLevel(self.saved[0])
        torch_lg.setLevel(self.saved[2])
        torch_lg.disabled = self.saved[3]
        if self.kind == "set_logs-off":
            torch._logging.set_logs()


@pytest.mark.parametrize(
    "kind", ["none", "disable-warning", "disable-critical", "basicConfig-error", "torch-logger-off", "set_logs-off"]
)
def test_graph_breaks_are_captured_whatever_the_logging_configuration(kind: str) -> None:
    line = line_of(with_break, "torch._dynamo.graph_break()")
    x = torch.randn(4).to("neuron")
    with _LoggingConfig(kind):
        out = torch.compile(with_break, backend="neuron")(x)
    torch.testing.assert_close(out.cpu(), with_break(x).cpu())
    (b,) = capture.graph_breaks()
    assert (b.filename, b.line, b.count, b.function) == (__file__, line, 1, "with_break")
    assert b.reason == "Call to `torch._dynamo.graph_break()`"
    assert b.explanation.startswith("User-inserted graph break")
    assert b.hints == ["Remove the `torch._dynamo.graph_break()` call."]
    assert b.counter == "graph_break"
    assert lab_counts() == dynamo_counts() and sum(dynamo_counts().values()) == 1


def test_a_break_in_a_loop_is_listed_under_the_counter_dynamo_uses() -> None:
    line = line_of(helper, "torch._dynamo.graph_break()")
    torch.compile(three_breaks, backend="eager")(torch.randn(3))
    breaks = capture.graph_breaks()
    # the loop frame is skipped (Dynamo counts "unimplemented"), helper then breaks and resumes
    # (Dynamo counts "graph_break") - once, though helper runs three times: its compile is cached
    assert sorted((b.line, b.counter, b.count) for b in breaks) == [
        (line, "graph_break", 1),
        (line, "unimplemented", 1),
    ]
    assert lab_counts() == dynamo_counts()
    unimpl = torch._dynamo.utils.counters["unimplemented"]
    for b in breaks:
        if b.counter == "unimplemented":
            assert unimpl[b.counter_key] == b.count


def test_item_break_counted_like_dynamo_and_its_warning_kept_out_of_the_output(
    capfd: pytest.CaptureFixture[str],
) -> None:
    line = line_of(with_item, "return x * x.sum().item()")
    with capture.quiet_dynamo() as out:
        torch.compile(with_item, backend="eager")(torch.randn(3))
    err = capfd.readouterr().err
    assert "Graph break" not in err and "capture_scalar_outputs" not in err
    assert "capture_scalar_outputs" in out.text  # Dynamo's W... "Graph break from Tensor.item()" block
    assert any(name.startswith("torch._dynamo") and lvl == "WARNING" for name, lvl, _ in out.records)
    assert [(b.line, b.counter) for b in capture.graph_breaks()] == [(line, "graph_break")]
    assert lab_counts() == dynamo_counts()


def test_quiet_dynamo_restores_logging_and_shows_user_warnings() -> None:
    lg = logging.getLogger("torch._dynamo")
    before = (list(lg.handlers), lg.propagate)
    with pytest.warns(UserWarning, match="from the user"):
        with capture.quiet_dynamo() as out:
            warnings.warn("from the user", UserWarning, stacklevel=1)
            logging.getLogger("torch._dynamo.test").warning("from dynamo %d", 7)
    assert (list(lg.handlers), lg.propagate) == before
    assert ("torch._dynamo.test", "WARNING", "from dynamo 7") in out.records
    assert out.warnings == []
    with pytest.raises(ValueError, match="inside"):
        with capture.quiet_dynamo():
            raise ValueError("inside")
    assert (list(lg.handlers), lg.propagate) == before


def test_gpt2_graph_breaks_equal_dynamos_counters() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
        out = torch.compile(model, backend="eager")(ids).logits
    torch.testing.assert_close(out, ref)
    assert lab_counts() == dynamo_counts()
    # no break is listed twice: one record per (location, Dynamo's message)
    keys = [(b.filename, b.line, b.counter_key) for b in capture.graph_breaks()]
    assert len(keys) == len(set(keys))


def test_dynamo_compile_time_excludes_another_backends_compile_of_the_same_function() -> None:
    x = torch.randn(32, 32).to("neuron")

    def f(t: torch.Tensor) -> torch.Tensor:
        return (t.sin() * 2).cos().sum()

    torch.compile(f, backend="eager")(x)  # Dynamo compiles frame 0/0 for another backend
    torch._dynamo.reset()  # compile ids restart: the neuron compile below is 0/0 again
    time.sleep(0.5)
    n0 = len(registry.records())
    t0 = time.perf_counter()
    torch.compile(f, backend="neuron")(x)
    wall_ms = (time.perf_counter() - t0) * 1e3
    (rec,) = registry.records()[n0:]
    dyn = rec.compile_ms["dynamo"]
    assert dyn is not None and 0 < dyn < wall_ms
    assert dyn + rec.compile_ms["aot_autograd"] + rec.compile_ms["lowering"] <= wall_ms
