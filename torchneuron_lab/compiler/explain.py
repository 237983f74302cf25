"""``explain(fn, *args)``: compile with the neuron backend, run, and report graphs, breaks and ops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import capture, registry
from .capture import GraphBreak, Recompile
from .registry import SubgraphRecord

__all__ = ["ExplainReport", "explain"]


@dataclass
class ExplainReport:
    """What compiling ``fn`` produced: graphs (registry records), graph breaks, recompiles, the output."""

    function: str
    graphs: list[SubgraphRecord] = field(default_factory=list)
    graph_breaks: list[GraphBreak] = field(default_factory=list)
    recompiles: list[Recompile] = field(default_factory=list)
    output: Any = None

    @property
    def graph_count(self) -> int:
        """Dynamo graphs (a forward/backward pair counts once)."""
        return len({g.graph_key for g in self.graphs})

    @property
    def break_count(self) -> int:
        return sum(b.count for b in self.graph_breaks)

    def ops_per_graph(self) -> dict[int, int]:
        return {g.id: g.num_ops for g in self.graphs}

    def as_dict(self) -> dict[str, Any]:
        return {
            "function": self.function,
            "graph_count": self.graph_count,
            "break_count": self.break_count,
            "graphs": [g.as_dict() for g in self.graphs],
            "graph_breaks": [b.as_dict() for b in self.graph_breaks],
            "recompiles": [r.as_dict() for r in self.recompiles],
        }

    def __str__(self) -> str:
        lines = [f"{self.function}: {self.graph_count} graph(s), {self.break_count} graph break(s), "
                 f"{len(self.recompiles)} recompile(s)"]
        for g in self.graphs:
            lines.append(f"  graph #{g.id} [{g.kind}] {g.name}: {g.num_ops} ops, {len(g.kernels)} kernels"
                         + (f", fallbacks: {', '.join(g.fallbacks)}" if g.fallbacks else ""))
        for b in self.graph_breaks:
            lines.append(f"  break at {b.location}: {b.reason}" + (f" (x{b.count})" if b.count > 1 else ""))
            if b.hints:
                lines.append(f"    hint: {b.hints[0]}")
        for r in self.recompiles:
            lines.append(f"  recompile of {r.function} at {r.location}: {'; '.join(r.failures)}")
        return "\n".join(lines)


def _fresh_copy(fn: Any) -> Any:
    """A copy of a function (or bound method) with a new code object, so Dynamo compiles it afresh
    without resetting anyone else's compiled code. None for other callables."""
    import types

    if isinstance(fn, types.MethodType):
        inner = _fresh_copy(fn.__func__)
        return None if inner is None else types.MethodType(inner, fn.__self__)
    if not isinstance(fn, types.FunctionType):
        return None
    new = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__dict__.update(fn.__dict__)
    return new


def explain(fn: Any, *args: Any, **kwargs: Any) -> ExplainReport:
    """Compile ``fn`` with ``torch.compile(backend="neuron")``, call it once, and report.

    A plain function or method is compiled as a fresh copy (its own code object), so earlier compiles
    of it cannot hide anything and nobody else's compiled code is reset; other callables (e.g. an
    ``nn.Module``) reset Dynamo's caches first, like ``torch._dynamo.explain``.
    """
    import torch

    from .backend import register_backend

    register_backend()
    from torch._dynamo import convert_frame

    fresh = _fresh_copy(fn)
    if fresh is None:  # not a plain function or method (e.g. an nn.Module): start from empty caches
        torch._dynamo.reset()
        fresh = fn
    # code objects Dynamo had not met before: what this compile leaves on them (the frames of functions the
    # copy calls, and their resume functions after a break) is dropped afterwards. The user's own later
    # torch.compile of such a function reused them, compiled nothing and hit no break in a profile.
    trackers = (convert_frame.input_codes, convert_frame.output_codes)
    known = set().union(*(t.seen_ids for t in trackers))
    n_graphs = len(registry.records())
    # keyed as the capture keys its records: one site can have a record per Dynamo counter (a break Dynamo
    # first counts as "unimplemented", then as "graph_break"), and a key without the counter mixed them up
    n_breaks = {capture._key(b): b.count for b in capture.graph_breaks()}
    n_recompiles = len(capture.recompiles())
    compiled = torch.compile(fresh, backend="neuron")
    try:
        output = compiled(*args, **kwargs)
    finally:
        for tracker in trackers:
            for ref in list(tracker.seen):
                code = ref()
                if code is not None and id(code) not in known:
                    torch._C._dynamo.eval_frame.reset_code(code)
    breaks: list[GraphBreak] = []
    for b in capture.graph_breaks():
        before = n_breaks.get(capture._key(b), 0)
        if b.count > before:
            from dataclasses import replace

            breaks.append(replace(b, count=b.count - before))
    return ExplainReport(
        function=getattr(fn, "__qualname__", repr(fn)),
        graphs=registry.records()[n_graphs:],
        graph_breaks=breaks,
        recompiles=capture.recompiles()[n_recompiles:],
        output=output,
    )
