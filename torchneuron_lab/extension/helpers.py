"""The work behind each magic: plain functions from the shell's state to a result object."""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from ..tracing.frames import is_internal
from .results import (
    GraphBreaksResult,
    MemoryResult,
    PlacementResult,
    ProfileResult,
    SubgraphsResult,
    WatchLine,
)

__all__ = [
    "Watch",
    "graph_breaks",
    "memory",
    "placement",
    "profile_cell",
    "status_line",
    "subgraphs",
]

LARGE_CPU_TENSOR = 1 << 20  # bytes: a CPU tensor this large next to a neuron model is flagged

Mapper = Callable[[str, int], "str | None"]


class LabInputError(ValueError):
    """A user mistake in a magic's input; the magic turns it into a ``UsageError``."""


# --------------------------------------------------------------------------- load


def status_line() -> str:
    """One line: devices, HBM per device, profile, torch version, build time on a cold start."""
    import torch

    from ..device import current_config
    from ..device._backend import build_info, lib

    lib()
    cfg = current_config()
    from .results import fmt_bytes

    line = (f"torchneuron_lab: {cfg['num_devices']} neuron device(s) (emulated), "
            f"{fmt_bytes(cfg['hbm_bytes'])} HBM each, profile {cfg['profile']}, torch {torch.__version__}")
    info = build_info()
    if info and not info.get("cached", True):
        line += f", C++ core built in {float(str(info.get('seconds', 0.0))):.1f} s"
    return line


# --------------------------------------------------------------------------- placement


def _dev(t: Any) -> str:
    return str(t.device)


def _held(t: Any) -> list[Any]:
    """The dense tensors that hold a tensor's memory: itself, or a sparse tensor's members (a sparse tensor has
    no storage of its own: ``untyped_storage()`` raises)."""
    import torch

    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return [t]


def _nbytes(t: Any) -> int:
    return sum(m.numel() * m.element_size() for m in _held(t))


def placement(ns: Mapping[str, Any], names: list[str] | None, show_all: bool) -> PlacementResult:
    """Tensors, modules and optimizers of ``ns`` (or the named ones) with per-device totals."""
    import torch

    if names:
        missing = [n for n in names if n not in ns]
        if missing:
            raise LabInputError(f"not defined in the namespace: {', '.join(missing)}")
        items = [(n, ns[n]) for n in names]
    else:
        items = [(n, v) for n, v in ns.items() if not n.startswith("_")]
    res = PlacementResult()
    storages: dict[tuple[str, int], str] = {}  # (device, storage ptr) -> first name
    totals: dict[str, int] = defaultdict(int)

    def add_tensor(name: str, kind: str, t: torch.Tensor, listed: bool) -> None:
        sparse = t.layout != torch.strided  # its memory is its members' storages
        note = f"{str(t.layout).removeprefix('torch.')}, nnz {t._nnz()}" if sparse else ""
        for m in _held(t):
            st = m.untyped_storage()
            key = (_dev(m), st.data_ptr())
            if key in storages and st.nbytes():
                if not sparse:
                    owner = storages[key]
                    note = f"view of {owner}" if t._is_view() else f"shares storage with {owner}"
            else:
                storages[key] = name
                totals[_dev(m)] += st.nbytes()
                if not sparse and t._is_view():
                    note = "view"
        if listed:
            res.rows.append({
                "name": name, "kind": kind, "device": _dev(t), "dtype": str(t.dtype).removeprefix("torch."),
                "shape": tuple(t.shape), "bytes": _nbytes(t),
                "requires_grad": bool(t.requires_grad), "storage": note,
            })

    neuron_models: list[str] = []
    cpu_tensors: list[tuple[str, int]] = []
    for name, v in items:
        if isinstance(v, torch.nn.Module):
            devices: set[str] = set()
            size = 0
            n_params = 0
            for pname, prm in v.named_parameters():
                devices.add(_dev(prm))
                size += _nbytes(prm)
                n_params += 1
                add_tensor(f"{name}.{pname}", "parameter", prm, show_all)
            for bname, b in v.named_buffers():
                devices.add(_dev(b))
                size += _nbytes(b)
                add_tensor(f"{name}.{bname}", "buffer", b, show_all)
            res.rows.append({"name": name, "kind": "module", "device": ", ".join(sorted(devices)) or "-",
                             "dtype": "", "shape": f"{n_params} params", "bytes": size,
                             "requires_grad": any(p.requires_grad for p in v.parameters()), "storage": ""})
            if len(devices) > 1:
                res.warnings.append(f"module {name} is split across devices: {', '.join(sorted(devices))}")
            if any(d.startswith("neuron") for d in devices):
                neuron_models.append(name)
        elif isinstance(v, torch.optim.Optimizer):
            size = 0
            bad: set[tuple[str, str]] = set()
            index = {id(q): i for i, q in enumerate(q for g in v.param_groups for q in g["params"])}
            for p, state in v.state.items():
                for sname, st in state.items():
                    if not isinstance(st, torch.Tensor):
                        continue
                    size += _nbytes(st)
                    add_tensor(f"{name}.state[{index.get(id(p), '?')}].{sname}", "optimizer_state", st, show_all)
                    if st.dim() > 0 and st.device != p.device:
                        bad.add((_dev(st), _dev(p)))
            res.rows.append({"name": name, "kind": "optimizer", "device": "", "dtype": "",
                             "shape": f"{sum(len(g['params']) for g in v.param_groups)} params", "bytes": size,
                             "requires_grad": False, "storage": ""})
            for s_dev, p_dev in sorted(bad):
                res.warnings.append(f"optimizer {name} keeps state on {s_dev} for parameters on {p_dev}")
        elif isinstance(v, torch.Tensor):
            add_tensor(name, "parameter" if isinstance(v, torch.nn.Parameter) else "tensor", v, True)
            nbytes = _nbytes(v)
            if v.device.type == "cpu" and nbytes >= LARGE_CPU_TENSOR:
                cpu_tensors.append((name, nbytes))
    if neuron_models:
        from .results import fmt_bytes

        for tname, nb in cpu_tensors:
            res.warnings.append(f"large CPU tensor {tname} ({fmt_bytes(nb)}) next to neuron model(s) "
                                f"{', '.join(neuron_models)}: move it with .to('neuron')?")
    res.totals = dict(sorted(totals.items()))
    return res


# --------------------------------------------------------------------------- graph breaks


def _assigned_names(body: list[ast.stmt]) -> list[str]:
    names: list[str] = []
    for node in body:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store) and sub.id not in names:
                names.append(sub.id)
            if isinstance(sub, (ast.FunctionDef, ast.ClassDef)) and sub in body and sub.name not in names:
                names.append(sub.name)
    return names


def _as_function(code: str, first_line: int, filename: str, ns: dict[str, Any]) -> Callable[[], Any]:
    """Compile ``code`` as the body of a function whose globals are ``ns`` (assignments stay global).

    ``first_line`` is the cell line the code starts on, so that locations name the notebook line.
    """
    try:
        tree = ast.parse(code)
        compile(tree, filename, "exec", dont_inherit=True)  # `return`/`yield` outside a function, etc.
    except SyntaxError as e:
        raise LabInputError(f"cannot parse the statement: {e.msg} (line {e.lineno})") from None
    if not tree.body:
        raise LabInputError("nothing to compile: give a statement, e.g. %neuron_graph_breaks f(x)")
    ast.increment_lineno(tree, first_line - 1)
    body = list(tree.body)
    last = body[-1]
    if isinstance(last, ast.Expr):
        body[-1] = ast.copy_location(ast.Return(value=last.value), last)
    names = _assigned_names(body)
    if names:
        body.insert(0, ast.copy_location(ast.Global(names=names), body[0]))
    fn = ast.FunctionDef(name="neuron_graph_breaks_statement", args=ast.arguments(
        posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=body, decorator_list=[], returns=None)
    ast.copy_location(fn, body[0])
    module = ast.Module(body=[fn], type_ignores=[])
    ast.fix_missing_locations(module)
    scope: dict[str, Any] = {}
    exec(compile(module, filename, "exec"), ns, scope)  # noqa: S102 - the user's own notebook code
    func: Callable[[], Any] = scope["neuron_graph_breaks_statement"]
    func.__qualname__ = code.strip().splitlines()[0][:60]
    return func


def graph_breaks(code: str, first_line: int, filename: str, ns: dict[str, Any]) -> GraphBreaksResult:
    """Compile ``code`` with the neuron backend, run it once, and report graphs/breaks/recompiles."""
    from ..compiler import explain

    fn = _as_function(code, first_line, filename, ns)
    report = explain(fn)
    graphs = [{"id": g.id, "kind": g.kind, "name": g.name, "ops": g.num_ops, "kernels": len(g.kernels),
               "fallbacks": list(g.fallbacks), "graph_key": g.graph_key} for g in report.graphs]
    breaks = [{"reason": b.reason, "location": b.location, "explanation": b.explanation, "hints": list(b.hints),
               "count": b.count, "function": b.function} for b in report.graph_breaks]
    recompiles = [{"function": r.function, "location": r.location, "failures": list(r.failures)}
                  for r in report.recompiles]
    return GraphBreaksResult(code.strip(), graphs, breaks, recompiles, report.output)


# --------------------------------------------------------------------------- subgraphs


def subgraphs(graph_id: int | None, code: bool, kernels: bool, clear: bool) -> SubgraphsResult:
    from ..compiler import registry

    if clear:
        return SubgraphsResult(cleared=registry.clear())
    if graph_id is not None:
        try:
            rec = registry.get(graph_id)
        except KeyError as e:
            raise LabInputError(str(e.args[0])) from None
        return SubgraphsResult(detail=rec.as_dict(), show_code=code, show_kernels=kernels)
    rows = [{"id": r.id, "kind": r.kind, "name": r.name, "ops": r.num_ops, "kernels": len(r.kernels),
             "calls": r.calls, "compile_ms": sum(v for v in r.compile_ms.values() if v is not None),
             "fallbacks": list(r.fallbacks)} for r in registry.records()]
    return SubgraphsResult(records=rows, show_code=code, show_kernels=kernels)


# --------------------------------------------------------------------------- memory



def _frame_location(frames: list[dict[str, Any]], mapper: Mapper | None) -> str:
    """The innermost user frame (frames are innermost first), mapped to its notebook cell."""
    for fr in frames:
        fn = str(fr.get("filename", ""))
        if is_internal(fn):
            continue
        line = int(fr.get("line", 0))
        mapped = mapper(fn, line) if mapper else None
        return mapped or f"{fn}:{line}"
    return "unknown (turn on %neuron_memory --history to record where allocations come from)"


def memory(device: int | None, segments: bool, history: bool, reset_peak: bool, snapshot_file: str | None,
           mapper: Mapper | None, top: int = 10) -> MemoryResult:

    from ..device import memory as mem
    from ..device._backend import lib
    from ..tracing.oom import external_fragmentation

    n = int(lib().device_count())
    d = 0 if device is None else device
    if not 0 <= d < n:
        raise LabInputError(f"--device must be in [0, {n - 1}], got {d}")
    notes: list[str] = []
    if history and not _history_on():
        mem._record_memory_history("all", context="all")
        _HISTORY[0] = True
        notes.append("allocator history recording is now on: allocations from here on carry their source line")
    snap = mem._snapshot()
    segs = [s for s in snap.get("segments", []) if s["device"] == d]
    by_loc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    free_blocks: list[int] = []
    largest = 0
    for s in segs:
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                acc = by_loc[_frame_location(list(b.get("frames") or []), mapper)]  # type: ignore[arg-type]
                acc[0] += 1
                acc[1] += int(b["size"])
            elif b["state"] == "inactive":
                free_blocks.append(int(b["size"]))
                largest = max(largest, int(b["size"]))
    top_rows = sorted(({"location": k, "count": v[0], "bytes": v[1]} for k, v in by_loc.items()),
                      key=lambda r: (-int(str(r["bytes"])), str(r["location"])))[:top]
    stats = dict(mem.memory_stats(d))
    seg_rows = [{"address": s["address"], "total_size": s["total_size"], "allocated_size": s["allocated_size"],
                 "segment_type": s["segment_type"],
                 "blocks": [{"state": b["state"], "size": b["size"], "address": b["address"]} for b in s["blocks"]]}
                for s in segs] if segments else []
    hist: list[dict[str, Any]] = []
    if history:
        traces = snap.get("device_traces") or []
        entries = traces[d] if d < len(traces) else []
        for e in entries[-top:]:
            hist.append({"action": e.get("action", ""), "size": int(e.get("size", 0)),
                         "location": _frame_location(list(e.get("frames") or []), mapper)})  # type: ignore[arg-type]
    if snapshot_file:
        import pickle

        with open(snapshot_file, "wb") as f:
            pickle.dump(snap, f)
        notes.append(f"snapshot written to {snapshot_file} (open it at https://pytorch.org/memory_viz)")
    oom = lib().last_oom(d)
    if oom is not None:
        oom = dict(oom)
        oom["frames"] = [{**fr, "location": _frame_location([fr], mapper)} for fr in oom.get("frames", [])
                         if not is_internal(str(fr.get("filename", "")))]
    if reset_peak:
        mem.reset_peak_memory_stats(d)
        notes.append(f"peak statistics of neuron:{d} reset (the figures above are from before)")
    return MemoryResult(
        device=d, stats=stats, capacity=int(lib().capacity(d)), top_allocations=top_rows, segments=seg_rows,
        fragmentation=external_fragmentation(free_blocks), largest_free_block=largest,
        history=hist, last_oom=oom, notes=notes, snapshot=dict(snap),
    )


_HISTORY = [False]


def _history_on() -> bool:
    return _HISTORY[0]


# --------------------------------------------------------------------------- profile


def _memory_now() -> dict[int, tuple[int, int]]:
    from ..device import memory as mem
    from ..device._backend import lib

    if not lib().runtime_started():
        return {}
    return {d: (int(mem.memory_allocated(d)), int(mem.max_memory_allocated(d)))
            for d in range(int(lib().device_count()))}


def _plan_check_waits() -> tuple[int, int]:
    """(first launches checked on the host, ns the host waited for the stream in them) so far: the
    emulator's own waits, which are not syncs of the program (no recorded event)."""
    from ..device._backend import lib

    n, ns = lib().plan_check_waits()
    return int(n), int(ns)


def profile_cell(run: Callable[[], Any], *, record_shapes: bool, memory_peak: bool, top: int,
                 ) -> tuple[ProfileResult, Any, BaseException | None]:
    """Run ``run()`` with the recorder on (stacks included); the recorder is stopped even if it raises.

    With ``memory_peak`` the peak statistics are reset first and allocator history recording is on
    during the cell (the previous recording state is restored afterwards); ``result.memory_snapshot``
    then holds the allocator snapshot with the cell's history only.

    Returns ``(result, value of the cell's last expression, exception or None)``: the cell's exception
    is not raised here; it is described in ``result.error``.
    """

    from ..compiler import capture, registry
    from ..device import memory as mem
    from ..device import recorder
    from ..tracing import summarize

    if recorder.is_recording():
        # Profiling clears and stops the recorder: inside another %%neuron_profile cell (or a recording the
        # user started) it would silently empty the outer one.
        raise LabInputError(
            "the kernel recorder is already recording (this cell runs inside another %%neuron_profile, or "
            "torchneuron_lab.device.recorder.start() was called without stop()); profiles do not nest: "
            "profile the outer cell only, or call recorder.stop() first"
        )
    marks: list[int] = []
    turned_on = False
    prev_history = mem._history_state()
    if memory_peak:
        from ..device._backend import lib

        for d in range(int(lib().device_count())):
            mem.reset_peak_memory_stats(d)
        if prev_history["enabled"] == "all" and prev_history["context"] is not None:
            marks = [len(t) for t in mem._snapshot().get("device_traces", [])]  # keep the cell's entries only
        else:  # bounded: the newest 100k allocator actions (a long run must not grow without limit)
            mem._record_memory_history("all", context="all", max_entries=100_000)
            turned_on = True
    before = _memory_now()
    n_graphs = len(registry.records())
    break_marks = {id(b): b.count for b in capture.graph_breaks()}  # a repeated break raises its count
    recorder.clear()
    # a long run keeps its first events (warm-up, new signatures) and its newest; the rest is counted
    recorder.start(record_shapes=record_shapes, with_stack=True, keep_first=recorder.DEFAULT_CAPACITY // 8)
    error: BaseException | None = None
    value = None
    from .backward_sites import BackwardSites, attribute

    sites = BackwardSites(getattr(recorder, "_source_mapper", None))
    checks0 = _plan_check_waits()
    try:
        with sites:
            value = run()
    except BaseException as e:  # noqa: BLE001 - the caller shows it, after the lab state is consistent
        error = e
    finally:
        recorder.stop()
        checks1 = _plan_check_waits()
        trace = recorder.read()
        recorder.clear()
        attribute(trace, sites.spans)  # backward kernels: the line of the .backward() call
        snapshot: dict[str, Any] | None = None
        if memory_peak:
            try:
                snapshot = dict(mem._snapshot())
                traces: list[Any] = list(snapshot.get("device_traces") or [])
                snapshot["device_traces"] = [t[marks[i]:] if i < len(marks) and marks[i] <= len(t) else t
                                             for i, t in enumerate(traces)]
            except Exception as exc:  # noqa: BLE001 - the peak is one line of the report: keep the rest (and
                # the cell's own error, which an exception raised here would replace)
                import warnings

                warnings.warn(f"torchneuron_lab: the memory snapshot failed ({type(exc).__name__}: {exc}); "
                              "the profile has no memory peak", RuntimeWarning, stacklevel=2)
                snapshot = None
            finally:
                if turned_on:  # we turned it on: restore what was there before
                    mem._record_memory_history(prev_history["enabled"], context=prev_history["context"],
                                               max_entries=prev_history["max_entries"])
    after = _memory_now()
    memory = {d: {"before": before.get(d, (0, 0))[0], "after": a, "peak": p} for d, (a, p) in after.items()
           if a or p or before.get(d, (0, 0))[0]}
    res = ProfileResult(
        trace=trace, summary=summarize(trace, k=None), top=top, memory=memory,
        new_subgraphs=[r.id for r in registry.records()[n_graphs:]],
        graph_breaks=[{"location": b.location, "reason": b.reason} for b in capture.graph_breaks()
                      if b.count > break_marks.get(id(b), 0)],
        error=None if error is None else (f"{type(error).__name__}: {error}" if str(error) else type(error).__name__),
        memory_snapshot=snapshot,
        plan_checks=checks1[0] - checks0[0], plan_check_wait_ns=checks1[1] - checks0[1],
    )
    return res, value, error


# --------------------------------------------------------------------------- watch


class Watch:
    """Ambient mode: records each cell (with stacks, so that a host wait names its line) and prints one
    line when the cell did something: kernels, transfers, syncs with the host's wait time and the lines
    that waited, new signatures, graph breaks, device memory."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.active = False
        self._owns_recorder = False
        self._sig_mark: dict[int, int] = {}
        self._breaks = 0
        self._mem: dict[int, tuple[int, int]] = {}
        self._extra = {"kernel": 0, "dma": 0, "sync": 0}
        self._waits: list[Any] = []
        self._suspended = False
        self._checks = (0, 0)  # _plan_check_waits() when the cell started
        self.last: WatchLine | None = None

    def _count_into(self, trace: Any, counts: dict[str, int]) -> None:
        """Add the trace's kernels, transfers and syncs to ``counts`` and keep its sync events (from the
        packed columns when the trace has them: no event objects for the kernels)."""
        cols = getattr(trace, "columns", None)
        if cols is not None:
            for kind, c in cols.kind_counts().items():
                if kind in counts:
                    counts[kind] += c
            self._waits.extend(cols.events_at(cols.rows_of_kind("sync")))
            return
        for e in trace:
            if e.kind in counts:
                counts[e.kind] += 1
            if e.kind == "sync":
                self._waits.append(e)

    def _start(self) -> None:
        from ..device import recorder

        recorder.clear()
        recorder.start(record_shapes=False, with_stack=True)
        self._owns_recorder = True

    def suspend(self) -> None:
        """Another lab recording (``%%neuron_profile``) takes the recorder: keep what this cell has run so
        far and stop recording until :meth:`resume`."""
        from ..device import recorder

        if self.active and self._owns_recorder:
            recorder.stop()
            self._count_into(recorder.read(), self._extra)
            recorder.clear()
            self._owns_recorder = False
            self._suspended = True

    def resume(self) -> None:
        """Record the rest of the cell again after :meth:`suspend`."""
        from ..device import recorder

        if self._suspended:
            self._suspended = False
            if self.active and not recorder.is_recording():
                self._start()

    def note_profiled(self, result: Any) -> None:
        """Count the kernels, transfers and syncs a profiled cell ran (its recording was not ours)."""
        if self.active:
            self._count_into(result.trace, self._extra)

    def pre_run_cell(self, info: Any = None) -> None:
        from ..compiler import capture, signatures
        from ..device import recorder

        self._sig_mark = signatures.mark()
        self._extra = {"kernel": 0, "dma": 0, "sync": 0}
        self._waits = []
        self._breaks = sum(b.count for b in capture.graph_breaks())
        self._mem = _memory_now()
        self._checks = _plan_check_waits()
        if self._owns_recorder:  # still ours (turned on by %neuron_watch earlier in this cell)
            recorder.clear()
            return
        if not recorder.is_recording():
            self._start()

    def post_run_cell(self, result: Any = None) -> None:
        try:
            line = self.collect(getattr(result, "execution_count", None))
        except KeyboardInterrupt as e:
            # Ctrl-C while the watch waited for the cell's queued kernels: those not yet run were dropped (as in
            # any host wait), so the cell fails as if the Ctrl-C had landed in it (it reported success, and its
            # later results were never computed). The front end sees the cell's error (its status, Run All).
            if result is not None and result.error_before_exec is None and result.error_in_exec is None:
                result.error_in_exec = e
            print("KeyboardInterrupt: while %neuron_watch waited for this cell's queued kernels; the kernels not "
                  "yet run were dropped, so this cell's later results were not computed", file=sys.stderr)
            return
        if line.eventful:
            print(line)

    def release(self) -> None:
        """Stop the recording this watch started (when it is turned off mid-cell)."""
        from ..device import recorder

        if self._owns_recorder:
            self._owns_recorder = False
            try:
                recorder.stop()
            finally:
                recorder.clear()

    def collect(self, cell: int | None) -> WatchLine:
        from ..compiler import capture, signatures
        from ..device import recorder
        from ..tracing import host_waits

        counts = dict(self._extra)
        self._extra = {"kernel": 0, "dma": 0, "sync": 0}
        if self._owns_recorder:
            self._owns_recorder = False
            try:
                recorder.stop()  # waits for the cell's queued kernels (a Ctrl-C there propagates)
                self._count_into(recorder.read(), counts)
            finally:
                recorder.clear()
        waits = host_waits(self._waits, top=3)
        self._waits = []
        new = sum(len(v) for v in signatures.new_since(self._sig_mark).values())
        breaks = sum(b.count for b in capture.graph_breaks()) - self._breaks
        mem = _memory_now()
        changed = any(mem.get(d) != self._mem.get(d) for d in set(mem) | set(self._mem))
        shown = {d: v for d, v in mem.items() if v != (0, 0)}
        checks = _plan_check_waits()
        self.last = WatchLine(cell=cell, kernels=counts["kernel"], transfers=counts["dma"], syncs=counts["sync"],
                              new_signatures=new, graph_breaks=max(breaks, 0), memory=shown,
                              memory_changed=changed, host_wait_ns=waits["wait_ns"],
                              wait_lines=waits["by_location"], plan_checks=checks[0] - self._checks[0],
                              plan_check_wait_ns=checks[1] - self._checks[1])
        return self.last
