"""The subgraph registry: one plain-data record per graph the ``neuron`` backend compiled."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SubgraphRecord", "clear", "export_json", "get", "list_subgraphs", "records"]


@dataclass
class SubgraphRecord:
    """What the JIT compiled for one graph.

    Attributes:
        id: registry id (1, 2, ...), unique for the process.
        name: readable name, e.g. ``"forward of train_step (compile 0/0)"``.
        kind: ``"forward"``, ``"backward"`` or ``"inference"``.
        compile_id: Dynamo's compile id (``"frame/recompile"``), e.g. ``"0/1"``.
        graph_key: id shared by the forward and backward of one Dynamo graph.
        pair_id: registry id of the matching backward/forward, or None.
        function: the user function Dynamo traced (resume functions keep Dynamo's name).
        source: user source lines of the graph's ops, ``[{"filename", "line", "name", "code", "location"}]``
            (``location`` is ``"cell [n], line k"`` in a notebook when the extension maps it).
        fx_code: the ATen-level FX graph as readable Python.
        op_counts: ATen op -> count in the graph.
        inputs: input signature: ``[{"shape", "dtype", "device", "dynamic_dims"}]`` (ints for scalars).
        guards: Dynamo's guards for this compile, as readable text lines.
        compile_ms: time split by stage: ``dynamo``, ``aot_autograd``, ``lowering`` (Inductor C++ codegen
            and build), measured in milliseconds; None where a stage did not run for this record.
        kernels: fused kernels: ``[{"name", "aten_ops", "kind"}]`` (kind ``fused`` or ``extern``).
        fallbacks: ATen ops the lowering left to ATen kernels (run on device memory, not fused).
        calls: times the compiled graph ran.
        cache_hits: Inductor FX-graph cache hits while compiling this record (0 or 1).
        device: neuron device index the graph runs on.
        launch: how the graph runs: ``"queued"`` (its kernels are launched on the device's stream, like
            eager kernels, and the call returns before they ran) or why it runs on the host after waiting
            for its stream (inputs or outputs off the device, ``TORCHNEURON_LAB_QUEUE_GRAPHS=0``, ...).
    """

    id: int
    name: str
    kind: str
    compile_id: str
    graph_key: int
    function: str
    pair_id: int | None = None
    source: list[dict[str, Any]] = field(default_factory=list)
    fx_code: str = ""
    op_counts: dict[str, int] = field(default_factory=dict)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    guards: list[str] = field(default_factory=list)
    compile_ms: dict[str, float | None] = field(default_factory=dict)
    kernels: list[dict[str, Any]] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    calls: int = 0
    cache_hits: int = 0
    device: int = 0
    launch: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def num_ops(self) -> int:
        return sum(self.op_counts.values())


_lock = threading.Lock()
_records: list[SubgraphRecord] = []
_next_id = 1


def _new_id() -> int:
    global _next_id
    with _lock:
        rid = _next_id
        _next_id += 1
        return rid


def _add(rec: SubgraphRecord) -> SubgraphRecord:
    with _lock:
        _records.append(rec)
    return rec


def _pending_guards(compile_id: str) -> list[SubgraphRecord]:
    """Records of ``compile_id`` still waiting for their guards (Dynamo logs them after the backend)."""
    with _lock:
        return [r for r in _records if r.compile_id == compile_id and not r.guards]


def records() -> list[SubgraphRecord]:
    """All records, oldest first (the live objects: ``calls`` keeps counting)."""
    from . import capture

    with _lock:
        out = list(_records)
    for r in out:  # Dynamo builds guards after the backend returns: attach them on first read
        if not r.guards:
            r.guards = capture.guards_for(r.compile_id)
    return out


def get(record_id: int) -> SubgraphRecord:
    """The record with this id; ``KeyError`` naming the known ids otherwise."""
    for r in records():
        if r.id == record_id:
            return r
    known = [r.id for r in records()]
    raise KeyError(f"no compiled subgraph with id {record_id}; known ids: {known or 'none'}")


def list_subgraphs(
    *, kind: str | None = None, function: str | None = None, where: Callable[[SubgraphRecord], bool] | None = None
) -> list[SubgraphRecord]:
    """Records filtered by kind (forward/backward/inference), function name substring, or a predicate."""
    if kind is not None and kind not in ("forward", "backward", "inference"):
        raise ValueError(f"kind must be 'forward', 'backward' or 'inference', got {kind!r}")
    out = []
    for r in records():
        if kind is not None and r.kind != kind:
            continue
        if function is not None and function not in r.function:
            continue
        if where is not None and not where(r):
            continue
        out.append(r)
    return out


def clear() -> int:
    """Forget all records; returns how many there were. Compiled code keeps running."""
    with _lock:
        n = len(_records)
        _records.clear()
        return n


def export_json(path: str | None = None) -> str:
    """All records as JSON (written to ``path`` when given)."""
    text = json.dumps([r.as_dict() for r in records()], indent=1, default=str)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text
