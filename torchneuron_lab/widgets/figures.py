"""Pure figure builders: plain event / snapshot / registry data in, ``plotly.graph_objects.Figure`` out.

Nothing here displays, prints, touches a device or keeps state; the widgets in :mod:`.timeline` wrap
these functions (STYLE habit 6). Inputs are the plain data of the other layers only (habit 5):

* :class:`~torchneuron_lab.tracing.KernelEvent` lists (or a :class:`~torchneuron_lab.tracing.Trace`);
* the ``torch.cuda``-format memory snapshot dict (``torch.neuron.memory._snapshot()``);
* subgraph records as dicts (``SubgraphRecord.as_dict()``) and graph breaks as dicts.

Timeline layout: one lane (y row) per ``device x engine`` in :data:`ENGINES` order, plus one ``host``
lane for host-side events (syncs). Each kernel is a horizontal bar (``go.Bar`` with ``base``) from start
to end that carries the hover text and the click payload (``customdata``), so the whole bar hovers and
clicks. Instants (syncs, OOMs, compile starts) are markers; above :data:`WEBGL_THRESHOLD` of them they are
``go.Scattergl``. Long idle stretches in which nothing at all was recorded are collapsed into shaded,
labelled breaks of the x axis (:func:`time_axis`, rule at :data:`BREAK_MIN_NS`), so the figure opens on
the activity.

Level of detail: :func:`lod_aggregate` merges runs of sub-pixel kernels of a lane into aggregate boxes
that carry their count; counts always add up to the events in the window (no kernel is lost). Times on
the x axis are microseconds since the trace's first event, less the collapsed breaks; tick labels,
hovers and the details panel give measured time.
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.basedatatypes import BaseFigure

from torchneuron_lab.tracing import ENGINES, KernelEvent, Trace, device_name
from torchneuron_lab.tracing.chrome_trace import write_atomically
from torchneuron_lab.tracing.events import displayable
from torchneuron_lab.tracing.frames import is_internal

__all__ = [
    "BREAK_FRACTION",
    "BREAK_MIN_NS",
    "FAMILIES",
    "HOST_LANE",
    "LAUNCH_COLOR",
    "LOD",
    "MAX_BREAKS",
    "MAX_FLOWS",
    "WEBGL_THRESHOLD",
    "EventColumns",
    "TimeAxis",
    "axis_ticks",
    "bound_of",
    "event_details",
    "event_location",
    "graph_break_rows",
    "graph_breaks_figure",
    "lane_label",
    "lanes_of",
    "lod_aggregate",
    "memory_figure",
    "memory_timeline",
    "op_family",
    "queue_depth_steps",
    "save_html",
    "segment_map_figure",
    "subgraph_rows",
    "subgraph_table_figure",
    "summary_text",
    "time_axis",
    "timeline_figure",
    "timeline_summary",
    "top_allocations",
]

#: Label of the single host lane (events on engine 'host' or with a negative device index).
HOST_LANE = "host"
#: Above this many points a trace is drawn with WebGL (``go.Scattergl``) instead of SVG.
WEBGL_THRESHOLD = 1500
#: Op families (colour groups) in legend order, with their colours.
FAMILIES: dict[str, str] = {
    "matmul": "#1f77b4",
    "elementwise": "#2ca02c",
    "reduction": "#9467bd",
    "copy/layout": "#8c564b",
    "dma": "#17becf",
    "compile": "#e377c2",
    "other": "#7f7f7f",
    "merged": "#bcbd22",
}
_SUBGRAPH_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_EAGER_COLOR = "#7f7f7f"

_FAMILY_RES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("matmul", re.compile(r"(?<![a-z])(mm|bmm|addmm|baddbmm|matmul|linear|conv\w*|convolution|einsum|dot|mv)(?![a-z])")),
    ("reduction", re.compile(r"(sum|mean|max|min|amax|amin|argmax|argmin|prod|norm|softmax|var|std|any|all)")),
    ("copy/layout", re.compile(r"(copy|clone|cat|stack|index|gather|scatter|contiguous|fill|zero|empty|view|"
                                r"permute|transpose|expand|slice|select|as_strided|_to_copy|where)")),
)


def op_family(name: str, kind: str = "kernel") -> str:
    """Colour group of an event: 'dma' and 'compile' by kind, kernels by op name, else 'other'."""
    if kind == "dma":
        return "dma"
    if kind == "compile":
        return "compile"
    low = name.lower()
    for family, pattern in _FAMILY_RES:
        if pattern.search(low):
            return family
    if low.startswith("aten::") or "fused" in low or "kernel" in low:
        return "elementwise"
    return "other"


def lane_label(device: int, engine: str, stream: int = 0) -> str:
    """'neuron:0 · tensor' (the default stream), 'neuron:0 · s1 · dma' (stream 1); the host lane is 'host'."""
    if engine == "host" or device < 0:
        return HOST_LANE
    if stream > 0:
        return f"{device_name(device)} · s{stream} · {engine}"
    return f"{device_name(device)} · {engine}"


def _engine_key(engine: str) -> tuple[int, str]:
    return (ENGINES.index(engine), "") if engine in ENGINES else (len(ENGINES), engine)


def _lane_key_of(device: int, stream: int, engine: str) -> tuple[int, int, str]:
    """(device, stream, engine) of the lane an event is drawn on (host events: (-1, -1, 'host'))."""
    if engine == "host" or device < 0:
        return (-1, -1, "host")
    return (device, max(stream, 0), engine)


def _lane_key(e: KernelEvent) -> tuple[int, int, str]:
    return _lane_key_of(e.device, e.stream, e.engine)


def lanes_of(events: Iterable[KernelEvent]) -> list[str]:
    """Lane labels present in ``events``, in display order: devices ascending, then streams ascending,
    engines in :data:`ENGINES` order, the host lane last (also present when a kernel carries its host
    launch span: the launch is drawn there)."""
    keys: set[tuple[int, int, str]] = set()
    for e in events:
        keys.add(_lane_key(e))
        if e.host_end_ns > 0:
            keys.add((-1, -1, "host"))
    return _lanes_from_keys(keys)


# ------------------------------------------------------------------------------------ columns
@dataclass
class EventColumns:
    """Events as numpy columns, built once per figure (1,000,000 events in well under a second).

    ``lane`` indexes :attr:`lanes`; ``idx`` is the position in :attr:`events`.
    """

    events: list[KernelEvent]
    lanes: list[str]
    start: np.ndarray
    end: np.ndarray
    lane: np.ndarray
    kind: np.ndarray
    kinds: list[str]
    t0: int
    #: host launch span of each event (0, 0 when unknown); :attr:`launched` marks the known ones
    host_start: np.ndarray | None = None
    host_end: np.ndarray | None = None
    #: index of the host lane in :attr:`lanes` (-1: none)
    host_lane: int = -1
    device: np.ndarray | None = None
    #: (start, end) of the stretch a bounded recording dropped events from: not idle, not recorded
    unrecorded: tuple[int, int] | None = None
    #: derived columns computed once per trace (queue depth, launch columns): zooms reuse them
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, events: Trace | Iterable[KernelEvent]) -> EventColumns:
        evs = list(events.events if isinstance(events, Trace) else events)
        n = len(evs)

        def column(name: str) -> np.ndarray:  # C-level iteration: no Python frame per event
            return np.fromiter(map(attrgetter(name), evs), dtype=np.int64, count=n)

        start, end, h_end = column("start_ns"), column("end_ns"), column("host_end_ns")
        launched = h_end > 0
        h_start = column("host_start_ns") if launched.any() else h_end
        raw = list(map(attrgetter("device", "stream", "engine"), evs))
        lane_keys = {k: _lane_key_of(*k) for k in set(raw)}
        key_set = set(lane_keys.values()) | ({(-1, -1, "host")} if launched.any() else set())
        lanes = _lanes_from_keys(key_set)
        pos = {lab: i for i, lab in enumerate(lanes)}
        raw_to_lane = {k: pos[lane_label(lk[0], lk[2], lk[1])] for k, lk in lane_keys.items()}
        lane = np.fromiter(map(raw_to_lane.__getitem__, raw), dtype=np.int32, count=n)
        kinds_seen = list(dict.fromkeys(map(attrgetter("kind"), evs)))
        kind_codes = {k: i for i, k in enumerate(kinds_seen)}
        kind = np.fromiter(map(kind_codes.__getitem__, map(attrgetter("kind"), evs)), dtype=np.int8, count=n)
        # one device per lane (the host lane: -1); work on a device never sits on the host lane
        lane_device = np.full(len(lanes), -1, dtype=np.int32)
        for k, lk in lane_keys.items():
            if lk[2] != "host":
                lane_device[raw_to_lane[k]] = lk[0]
        device = lane_device[lane] if n else np.zeros(0, dtype=np.int32)
        t0 = int(start.min()) if n else 0
        if launched.any():
            t0 = min(t0, int(h_start[launched].min()))
        from torchneuron_lab.tracing.summary import unrecorded_window

        return cls(evs, lanes, start, end, lane, kind, kinds_seen, t0, h_start, h_end, pos.get(HOST_LANE, -1),
                   device, unrecorded_window(events))

    @property
    def launched(self) -> np.ndarray:
        """Mask of the events whose host launch span is known (an asynchronous trace)."""
        if self.host_end is None:
            return np.zeros(len(self.events), dtype=bool)
        return self.host_end > 0

    @property
    def is_async(self) -> bool:
        """True when any event carries its host launch span."""
        return bool(self.launched.any())

    def launch_columns(self) -> EventColumns:
        """The launches as columns of their own, for :func:`lod_aggregate`: each event's host span on the
        host lane (events without a launch span keep their own times; mask them with :attr:`launched`)."""
        if "launch_columns" in self.cache:
            return self.cache["launch_columns"]  # type: ignore[no-any-return]
        launched = self.launched
        start = np.where(launched, self.host_start, self.start) if self.host_start is not None else self.start
        end = np.where(launched, self.host_end, self.end) if self.host_end is not None else self.end
        lane = np.where(launched, self.host_lane, self.lane).astype(np.int32)
        out = EventColumns(self.events, self.lanes, start, end, lane, self.kind, self.kinds, self.t0,
                           self.host_start, self.host_end, self.host_lane, self.device)
        self.cache["launch_columns"] = out
        return out

    def extent(self) -> tuple[int, int]:
        """First start (host launches included) and last end, in ns (0, 0 when empty)."""
        if not len(self.events):
            return 0, 0
        return self.t0, int(self.end.max())

    def kind_mask(self, *kinds: str) -> np.ndarray:
        """Boolean mask of the events whose kind is one of ``kinds``."""
        codes = [i for i, k in enumerate(self.kinds) if k in kinds]
        return np.isin(self.kind, codes)


def _lanes_from_keys(keys: set[tuple[int, int, str]]) -> list[str]:
    dev = sorted({k for k in keys if k[2] != "host" and k[0] >= 0}, key=lambda k: (k[0], k[1], _engine_key(k[2])))
    labels = [lane_label(d, g, st) for d, st, g in dev]
    if any(g == "host" or d < 0 for d, _, g in keys):
        labels.append(HOST_LANE)
    return labels


# ------------------------------------------------------------------------------------ LOD
@dataclass
class LOD:
    """Result of :func:`lod_aggregate`: boxes to draw, singles and merged aggregates.

    Attributes:
        singles: indices (into the input events) drawn as themselves.
        agg_lane, agg_start, agg_end, agg_count, agg_busy, agg_first, agg_last: one entry per merged
            box: lane index, extent (ns), how many events it stands for, their summed duration and
            the indices of its first and last event.
        pixel_ns: the time one pixel covered.
        window: ``(t0, t1)`` in ns.
        total: events overlapping the window (``len(singles) + agg_count.sum()``).
    """

    singles: np.ndarray
    agg_lane: np.ndarray
    agg_start: np.ndarray
    agg_end: np.ndarray
    agg_count: np.ndarray
    agg_busy: np.ndarray
    agg_first: np.ndarray
    agg_last: np.ndarray
    pixel_ns: float
    window: tuple[int, int]
    total: int

    @property
    def num_boxes(self) -> int:
        return int(len(self.singles) + len(self.agg_count))

    def counts_by_lane(self, lane: np.ndarray) -> dict[int, int]:
        """Events represented per lane index (singles + merged counts)."""
        out: dict[int, int] = {}
        for ln, c in zip(*np.unique(lane[self.singles], return_counts=True)):
            out[int(ln)] = out.get(int(ln), 0) + int(c)
        for ln, c in zip(self.agg_lane.tolist(), self.agg_count.tolist()):
            out[int(ln)] = out.get(int(ln), 0) + int(c)
        return out


def lod_aggregate(
    events: EventColumns | Trace | Iterable[KernelEvent],
    t0: int | None = None,
    t1: int | None = None,
    pixels: int = 1200,
    *,
    mask: np.ndarray | None = None,
) -> LOD:
    """Merge sub-pixel events per lane for a view of ``pixels`` pixels over ``[t0, t1]`` (ns).

    Within a lane, sorted by start, an event shorter than one pixel joins the preceding short event's
    box when it starts less than a pixel after everything before it ended; events one pixel or longer
    are always drawn on their own. A box that ends up holding one event is drawn as that event. Only
    events overlapping the window are considered; their number equals ``len(singles) +
    agg_count.sum()`` -- no kernel is lost. Zooming in (a smaller window) refines the boxes.

    Args:
        events: events or prebuilt :class:`EventColumns`.
        t0, t1: window in the events' nanoseconds (default: the whole trace).
        pixels: width of the plot area in pixels (> 0).
        mask: optional boolean mask over the events (e.g. only busy kinds).

    Raises:
        ValueError: ``pixels`` < 1 or a window that ends before it starts.
    """
    if pixels < 1:
        raise ValueError(f"pixels must be >= 1, got {pixels}")
    cols = events if isinstance(events, EventColumns) else EventColumns.build(events)
    n = len(cols.events)
    lo = int(cols.start.min()) if n else 0
    hi = int(cols.end.max()) if n else 0
    t0 = lo if t0 is None else int(t0)
    t1 = hi if t1 is None else int(t1)
    if t1 < t0:
        raise ValueError(f"window ends ({t1}) before it starts ({t0})")
    px = max((t1 - t0) / pixels, 1e-9)
    sel = (cols.end >= t0) & (cols.start <= t1)
    if mask is not None:
        sel &= mask
    idx = np.nonzero(sel)[0]
    empty = np.zeros(0, dtype=np.int64)
    if len(idx) == 0:
        return LOD(empty, empty, empty, empty, empty, empty, empty, empty, px, (t0, t1), 0)
    order = np.lexsort((cols.start[idx], cols.lane[idx]))
    idx = idx[order]
    lane = cols.lane[idx]
    start = cols.start[idx]
    end = cols.end[idx]
    small = (end - start) < px
    # running max of the end times inside each lane (reset at lane boundaries)
    new_lane = np.ones(len(idx), dtype=bool)
    new_lane[1:] = lane[1:] != lane[:-1]
    # cummax of the end times within lanes: shift each lane's values up by a lane-dependent constant
    # so that a global running max never carries over from a previous lane
    span = int(end.max() - start.min()) + 1
    shifted = end - int(start.min()) + lane.astype(np.int64) * span
    run_end = np.maximum.accumulate(shifted) - lane.astype(np.int64) * span + int(start.min())
    brk = np.ones(len(idx), dtype=bool)
    joins = small[1:] & small[:-1] & ~new_lane[1:] & ((start[1:] - run_end[:-1]) < px)
    brk[1:] = ~joins
    group_starts = np.nonzero(brk)[0]
    counts = np.diff(np.append(group_starts, len(idx)))
    single_groups = counts == 1
    singles = np.sort(idx[group_starts[single_groups]])
    ag = group_starts[~single_groups]
    agc = counts[~single_groups]
    if len(ag):
        g_end = np.maximum.reduceat(end, group_starts)[~single_groups]
        g_busy = np.add.reduceat(end - start, group_starts)[~single_groups]
        last = ag + agc - 1
        result = LOD(
            singles, lane[ag].astype(np.int64), start[ag], g_end, agc.astype(np.int64), g_busy,
            idx[ag], idx[last], px, (t0, t1), len(idx),
        )
    else:
        result = LOD(singles, empty, empty, empty, empty, empty, empty, empty, px, (t0, t1), len(idx))
    return result


# ------------------------------------------------------------------------------------ summary
_BUSY = ("kernel", "dma", "compile")


def timeline_summary(events: EventColumns | Trace | Iterable[KernelEvent]) -> dict[str, Any]:
    """What the summary bar shows, vectorised so that it stays fast at 1,000,000 events.

    Returns ``{"num_events", "span_ns", "busy_ns", "idle_ns", "idle_gaps", "syncs", "sync_wait_ns",
    "ooms", "compiles", "new_signatures", "engines": {engine: {"count", "total_ns", "busy_ns"}},
    "lanes": {label: {"count", "busy_ns", "idle_ns", "gaps"}}}``.

    Idle time has two definitions, kept apart: ``busy_ns`` / ``idle_ns`` / ``idle_gaps`` are the UNION
    OF LANES, as :func:`torchneuron_lab.tracing.summary.activity` defines it (time of the span in which
    no lane was busy: ``busy_ns + idle_ns == span_ns``), while ``lanes[...]`` are PER LANE as
    :func:`torchneuron_lab.tracing.idle_gaps` defines them (gaps strictly inside one lane's span; summed
    over lanes they can exceed the span). ``engines`` follows :func:`torchneuron_lab.tracing.time_by_engine`.
    A stretch a bounded recording dropped events from (``unrecorded_ns``) is neither busy nor idle, in the
    union and in each lane: ``busy_ns + idle_ns + unrecorded_ns == span_ns``.
    """
    cols = events if isinstance(events, EventColumns) else EventColumns.build(events)
    n = len(cols.events)
    busy_mask = cols.kind_mask(*_BUSY)
    sync_mask = cols.kind_mask("sync")
    lo, hi = cols.extent()
    out: dict[str, Any] = {
        "num_events": n,
        "span_ns": hi - lo,
        "syncs": int(sync_mask.sum()),
        "sync_wait_ns": int((cols.end[sync_mask] - cols.start[sync_mask]).sum()),
        "ooms": int(cols.kind_mask("oom").sum()),
        "compiles": int(cols.kind_mask("compile").sum()),
        "new_signatures": sum(1 for e in cols.events if e.new_signature) if n < 200_000 else None,
    }
    lanes: dict[str, dict[str, int]] = {}
    engines: dict[str, dict[str, int]] = {}
    idx = np.nonzero(busy_mask)[0]
    busy_union = 0
    union_gaps = 0
    if len(idx):
        # union of lanes: merge every busy interval regardless of its lane
        o = np.argsort(cols.start[idx], kind="stable")
        us, ue = cols.start[idx][o], cols.end[idx][o]
        run = np.maximum.accumulate(ue)
        inner = us[1:] - run[:-1]
        inner = inner[inner > 0]
        busy_union = int(run[-1] - us[0]) - int(inner.sum())
        union_gaps = len(inner) + int(us[0] > lo) + int(hi > run[-1])
        if cols.unrecorded is not None:  # busy time inside a dropped stretch is not known: clipped out
            from torchneuron_lab.tracing._columnar import _merged
            from torchneuron_lab.tracing.summary import clip_out

            ms, me = _merged(*clip_out(us, ue, cols.unrecorded))
            busy_union = int((me - ms).sum())
        order = np.lexsort((cols.end[idx], cols.start[idx], cols.lane[idx]))
        idx = idx[order]
        lane, start, end = cols.lane[idx], cols.start[idx], cols.end[idx]
        bounds = np.nonzero(np.r_[True, lane[1:] != lane[:-1], True])[0]
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            s, e = start[a:b], end[a:b]
            run = np.maximum.accumulate(e)
            inside = s[1:] > run[:-1]
            g0, g1 = run[:-1][inside], s[1:][inside]
            span = int(run[-1] - s[0])
            unrec = 0
            if cols.unrecorded is None:
                idle, n_gaps = int((g1 - g0).sum()), len(g0)
            else:  # a gap across the dropped stretch is two gaps, the stretch itself neither busy nor idle
                from torchneuron_lab.tracing.summary import unrecorded_ns

                w0, w1 = cols.unrecorded
                across = (g0 < w1) & (g1 > w0)
                left = np.where(across, np.minimum(g1, w0) - g0, g1 - g0)
                right = np.where(across, g1 - np.maximum(g0, w1), 0)
                idle = int(left.clip(min=0).sum() + right.clip(min=0).sum())
                n_gaps = int((left > 0).sum() + (right > 0).sum())
                unrec = unrecorded_ns(cols.unrecorded, int(s[0]), int(run[-1]))
            label = cols.lanes[int(lane[a])]
            busy = span - idle - unrec
            lanes[label] = {"count": b - a, "busy_ns": busy, "idle_ns": idle, "gaps": n_gaps}
            engine = label.split(" · ")[-1]
            row = engines.setdefault(engine, {"count": 0, "total_ns": 0, "busy_ns": 0})
            row["count"] += b - a
            row["total_ns"] += int((e - s).sum())
            row["busy_ns"] += busy
    elif n and hi > lo:
        union_gaps = 1
    order_e = sorted(engines, key=_engine_key)
    out["engines"] = {k: engines[k] for k in order_e}
    out["lanes"] = lanes
    from torchneuron_lab.tracing.summary import unrecorded_ns

    out["busy_ns"] = busy_union
    out["unrecorded_ns"] = unrecorded_ns(cols.unrecorded, lo, hi) if n else 0
    out["idle_ns"] = out["span_ns"] - busy_union - out["unrecorded_ns"]
    out["idle_gaps"] = union_gaps
    # what bounds the region needs the host side: only an asynchronous trace (launch spans) has it
    out["bound"] = bound_of(cols) if cols.is_async else None
    return out


def bound_of(cols: EventColumns) -> dict[str, Any]:
    """:func:`torchneuron_lab.tracing.classify_region` of the events, computed on the figure's columns
    (the same rule; only the sync events are looked at one by one)."""
    from torchneuron_lab.tracing._columnar import bound_from_arrays

    n = len(cols.events)
    dev = cols.device if cols.device is not None else np.zeros(n, dtype=np.int32)
    work = cols.kind_mask("kernel", "dma") & (dev >= 0)
    ws, we = cols.start[work], cols.end[work]
    h_start = cols.host_start[work] if cols.host_start is not None else ws
    h_end = cols.host_end[work] if cols.host_end is not None else ws
    syncs = [cols.events[i] for i in np.flatnonzero(cols.kind_mask("sync")).tolist()]
    lo, hi = cols.extent()
    return bound_from_arrays(ws, we, h_start, h_end, cols.launched[work], syncs, cols.unrecorded, lo, hi, n)


def queue_depth_steps(cols: EventColumns) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per device, the queue depth as a step function ``(t_ns, depth)``: kernels (and DMA) launched
    (``host_end_ns``; the start when unknown) and not yet finished, as
    :func:`torchneuron_lab.tracing.queue_depth` defines it, on whole columns."""
    if "queue_depth" in cols.cache:
        return cols.cache["queue_depth"]  # type: ignore[no-any-return]
    n = len(cols.events)
    dev = cols.device if cols.device is not None else np.zeros(n, dtype=np.int32)
    work = cols.kind_mask("kernel", "dma") & (dev >= 0)
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    cols.cache["queue_depth"] = out
    launched = cols.launched
    enq = np.minimum(np.where(launched, cols.host_end if cols.host_end is not None else cols.start, cols.start),
                     cols.start)
    for d in np.unique(dev[work]).tolist():
        sel = work & (dev == d)
        t = np.concatenate([enq[sel], cols.end[sel]])
        step = np.concatenate([np.ones(int(sel.sum()), np.int64), -np.ones(int(sel.sum()), np.int64)])
        o = np.argsort(t)  # changes at one instant are summed: their order does not matter
        t, step = t[o], step[o]
        level = np.cumsum(step)
        last = np.r_[t[1:] != t[:-1], True]  # the level after every change at the same instant
        t, level = t[last], level[last]
        keep = np.r_[True, level[1:] != level[:-1]]
        out[int(d)] = (t[keep], level[keep])
    return out


def summary_text(summary: Mapping[str, Any]) -> str:
    """Plain-text rendering of :func:`timeline_summary` (the terminal fallback)."""
    lines = [
        (
            f"{summary['num_events']:,} events over {_fmt_ns(summary['span_ns'])} "
            f"(some lane busy {_fmt_ns(summary['busy_ns'])}, every lane idle {_fmt_ns(summary['idle_ns'])} "
            f"in {summary['idle_gaps']} stretches"
            + (f", {_fmt_ns(summary['unrecorded_ns'])} not recorded" if summary.get("unrecorded_ns") else "")
            + "); "
            f"{summary['syncs']} host syncs (waited {_fmt_ns(summary['sync_wait_ns'])}), "
            f"{summary['compiles']} compiles, {summary['ooms']} OOMs"
        ),
        f"{'engine':<8} {'count':>10} {'total':>12} {'busy':>12}",
    ]
    for engine, row in summary["engines"].items():
        lines.append(f"{engine:<8} {row['count']:>10,} {_fmt_ns(row['total_ns']):>12} {_fmt_ns(row['busy_ns']):>12}")
    return "\n".join(lines)

# ------------------------------------------------------------------------------------ hover text
def _fmt_ns(ns: float) -> str:
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.2f} µs"
    if ns < 1e9:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.3f} s"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def _fmt_rate(amount: float, ns: int, unit: str) -> str:
    if ns <= 0:
        return "n/a"
    per_s = amount / (ns / 1e9)
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            return f"{per_s / scale:.2f} {prefix}{unit}/s"
    return f"{per_s:.2f} {unit}/s"


def event_location(e: KernelEvent, mapper: Any = None) -> str | None:
    """Where the event was launched: its notebook cell when the innermost user frame of its stack is a
    cell -- also when the recorder had no mapper (the widgets used without ``%load_ext torchneuron_lab``:
    the running IPython shell's cell map, :func:`_cell_mapper`) -- else ``e.location``."""
    src = e.location
    if not e.stack or (src and src.startswith("cell [")):
        return src
    m = mapper if mapper is not None else _cell_mapper()
    if m is None:
        return src
    for fr in reversed(e.stack):
        if is_internal(fr.filename):
            continue
        return m(fr.filename, fr.line) or src
    return src


def event_details(e: KernelEvent, profile: str | None = None, t0: int | None = None) -> dict[str, Any]:
    """The hover/details fields of one event as an ordered dict of label -> text (with ``t0``, the
    trace's first start in ns, also ``start``: the measured time since then)."""
    d: dict[str, Any] = {
        "op": e.name,
        "kind": e.kind,
        "lane": lane_label(e.device, e.engine, e.stream),
        "duration": _fmt_ns(e.dur_ns),
    }
    if e.kind == "sync":
        d["host waited"] = _fmt_ns(e.dur_ns)
        d["waited on"] = (f"{device_name(e.device)} (all streams)" if e.stream < 0
                          else f"{device_name(e.device)} stream {e.stream}")
    if t0 is not None:
        d["start"] = f"{_fmt_ns(e.start_ns - t0)} after the first event"
    if e.host_end_ns > 0:
        d["stream"] = str(e.stream)
        d["launched"] = (f"by the host in {_fmt_ns(e.host_end_ns - e.host_start_ns)}"
                         + (f", {_fmt_ns(e.host_start_ns - t0)} after the first event" if t0 is not None else ""))
        d["queued"] = f"{_fmt_ns(max(e.start_ns - e.host_end_ns, 0))} between launch and start"
        if e.correlation:
            d["correlation"] = str(e.correlation)
    if e.shapes:
        d["shapes"] = e.shapes
    if e.dtypes:
        d["dtypes"] = e.dtypes
    d["bytes"] = f"{_fmt_bytes(e.bytes_read)} read, {_fmt_bytes(e.bytes_written)} written"
    d["FLOPs"] = f"{e.flops:,}"
    d["achieved bandwidth"] = _fmt_rate(e.bytes_total, e.dur_ns, "B")
    if e.flops:
        d["achieved compute"] = _fmt_rate(e.flops, e.dur_ns, "FLOP")
    if e.direction:
        d["direction"] = e.direction
    d["source"] = event_location(e) or "unknown"
    d["subgraph"] = str(e.subgraph) if e.subgraph >= 0 else "eager"
    d["new signature"] = "yes (first seen: a NEFF compile on Trainium)" if e.new_signature else "no"
    if e.est_ns is not None:
        d["roofline estimate"] = f"{_fmt_ns(e.est_ns)} on {profile or 'the device profile'} (estimate, not measured)"
    d["seq"] = e.seq
    return d


def _hover_text(text: str) -> str:
    """Text for a plotly hover label: ``<``, ``>`` and ``&`` escaped (the label is plotly's own markup); quotes
    as they are, since plotly's labels do not decode ``&quot;`` (a name ``f("x")`` read ``f(&quot;x&quot;)``)."""
    return html.escape(text, quote=False)


def _hover_html(details: Mapping[str, Any]) -> str:
    head = f"<b>{_hover_text(str(details['op']))}</b>"
    rows = [f"{_hover_text(k)}: {_hover_text(str(v))}" for k, v in details.items() if k != "op"]
    return "<br>".join([head, *rows])


def _agg_hover(cols: EventColumns, lod: LOD, j: int) -> str:
    first = cols.events[int(lod.agg_first[j])]
    last = cols.events[int(lod.agg_last[j])]
    span = int(lod.agg_end[j] - lod.agg_start[j])
    return (
        f"<b>{int(lod.agg_count[j]):,} events merged</b> (zoom in to see each)<br>"
        f"lane: {_hover_text(cols.lanes[int(lod.agg_lane[j])])}<br>"
        f"span: {_fmt_ns(span)}, busy: {_fmt_ns(int(lod.agg_busy[j]))}<br>"
        f"first: {_hover_text(first.name)}<br>last: {_hover_text(last.name)}"
    )


# ------------------------------------------------------------------------------------ time axis
#: An idle stretch -- no event of any kind on any lane -- is drawn as a marked break of the x axis
#: (shaded, labelled with its measured length, compressed to :data:`BREAK_WIDTH` of the active time)
#: when it is at least ``BREAK_MIN_NS`` long AND at least ``BREAK_FRACTION`` of the trace's active time
#: (the span less every idle stretch of ``BREAK_MIN_NS`` or more). At most ``MAX_BREAKS`` (the longest)
#: are collapsed. So the first kernel's warm-up delay or a user's think-time between cells never fills
#: the view, while the short gaps between kernels of a loop stay to scale.
BREAK_MIN_NS = 1_000_000
BREAK_FRACTION = 0.25
BREAK_WIDTH = 0.04
MAX_BREAKS = 50


@dataclass
class TimeAxis:
    """Where a measured time is drawn on the timeline's x axis (µs).

    Piecewise linear through ``knots_ns`` (ns since ``t0``) -> ``knots_x`` (axis µs): slope 1 (1 µs per
    1,000 ns) everywhere except inside the collapsed idle ``breaks`` (``(start_ns, end_ns)`` pairs in the
    events' clock), so distances within a stretch of activity are true. Without breaks the axis is plain
    "µs since the first event".
    """

    t0: int
    span_ns: int
    breaks: list[tuple[int, int]]
    knots_ns: np.ndarray
    knots_x: np.ndarray

    @property
    def end_x(self) -> float:
        """Axis position of the last event's end."""
        return float(self.knots_x[-1])

    def x(self, t_ns: Any) -> np.ndarray:
        """Axis µs of measured times ``t_ns`` (events' clock, ns)."""
        rel = np.asarray(t_ns, dtype=np.int64) - self.t0
        rel_f = rel.astype(np.float64)
        out = np.interp(rel_f, self.knots_ns, self.knots_x)
        out = np.where(rel_f > self.knots_ns[-1], self.knots_x[-1] + (rel_f - self.knots_ns[-1]) / 1e3, out)
        return np.where(rel_f < 0, rel_f / 1e3, out)

    def t(self, x: Any) -> np.ndarray:
        """Measured times (events' clock, ns, int64) of axis positions ``x`` (µs): the inverse of :meth:`x`."""
        xf = np.asarray(x, dtype=np.float64)
        out = np.interp(xf, self.knots_x, self.knots_ns)
        out = np.where(xf > self.knots_x[-1], self.knots_ns[-1] + (xf - self.knots_x[-1]) * 1e3, out)
        out = np.where(xf < 0, xf * 1e3, out)
        return np.rint(out).astype(np.int64) + self.t0


def time_axis(
    events: EventColumns | Trace | Iterable[KernelEvent],
    *,
    min_ns: int = BREAK_MIN_NS,
    fraction: float = BREAK_FRACTION,
    max_breaks: int = MAX_BREAKS,
) -> TimeAxis:
    """The x axis of :func:`timeline_figure`: which idle stretches are collapsed (see :data:`BREAK_MIN_NS`)."""
    cols = events if isinstance(events, EventColumns) else EventColumns.build(events)
    n = len(cols.events)
    if n == 0:
        return TimeAxis(0, 0, [], np.zeros(2), np.zeros(2))
    lo, hi = cols.extent()
    starts, ends = cols.start, cols.end
    if cols.is_async:  # a host launch is activity too: its span is never collapsed
        launched = cols.launched
        starts = np.concatenate([starts, cols.host_start[launched]])  # type: ignore[index]
        ends = np.concatenate([ends, cols.host_end[launched]])  # type: ignore[index]
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run = np.maximum.accumulate(e)
    gap = s[1:] - run[:-1]
    cand = np.nonzero(gap >= min_ns)[0]
    active = (hi - lo) - int(gap[cand].sum())
    sel = cand[gap[cand] >= max(min_ns, fraction * active)]
    if len(sel) > max_breaks:
        sel = np.sort(sel[np.argsort(-gap[sel], kind="stable")[:max_breaks]])
    breaks = [(int(run[i]), int(s[i + 1])) for i in sel.tolist()]
    width = min(BREAK_WIDTH * active, 0.3 * active / max(len(breaks), 1)) / 1e3 if active > 0 else 1.0
    knots_ns, knots_x = [0.0], [0.0]
    for bs, be in breaks:
        knots_x.append(knots_x[-1] + (bs - lo - knots_ns[-1]) / 1e3)
        knots_ns.append(float(bs - lo))
        knots_x.append(knots_x[-1] + width)
        knots_ns.append(float(be - lo))
    knots_x.append(knots_x[-1] + (hi - lo - knots_ns[-1]) / 1e3)
    knots_ns.append(float(hi - lo))
    return TimeAxis(lo, hi - lo, breaks, np.asarray(knots_ns), np.asarray(knots_x))


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    exp = 10.0 ** np.floor(np.log10(raw))
    for m in (1.0, 2.0, 5.0, 10.0):
        if m * exp >= raw * (1 - 1e-9):
            return float(m * exp)
    return float(10 * exp)  # pragma: no cover


def _tick_unit(max_us: float) -> tuple[float, str]:
    return (1e6, "s") if max_us >= 1e6 else (1e3, "ms") if max_us >= 1e3 else (1.0, "µs")


def _fmt_tick(us: float, step_us: float, unit: tuple[float, str]) -> str:
    scale, name = unit
    decimals = max(0, int(np.ceil(-np.log10(step_us / scale) - 1e-9)))
    return f"{us / scale:,.{decimals}f} {name}"


def axis_ticks(axis: TimeAxis, x_lo: float | None = None, x_hi: float | None = None,
               n: int = 12) -> tuple[list[float], list[str]]:
    """Tick positions (axis µs) and labels (measured time since the first event) for the visible
    ``[x_lo, x_hi]`` of a compressed axis: round values of measured time inside each stretch of activity,
    never inside a break."""
    x_lo = 0.0 if x_lo is None else float(x_lo)
    x_hi = axis.end_x if x_hi is None else float(x_hi)
    if x_hi <= x_lo:
        return [], []
    step = _nice_step((x_hi - x_lo) / n)
    edges = [0.0] + [v for b in axis.breaks for v in (float(b[0] - axis.t0), float(b[1] - axis.t0))] + [
        float(axis.span_ns)]
    vals: list[float] = []
    texts: list[str] = []
    unit = _tick_unit(float(axis.t(np.asarray([x_hi]))[0] - axis.t0) / 1e3)
    for a_ns, b_ns in zip(edges[0::2], edges[1::2]):
        xa, xb = axis.x(np.asarray([a_ns, b_ns]) + axis.t0).tolist()
        lo_x, hi_x = max(xa, x_lo), min(xb, x_hi)
        if hi_x < lo_x:
            continue
        # inside a stretch, axis µs and measured µs differ by a constant
        off = a_ns / 1e3 - xa
        k0, k1 = int(np.ceil((lo_x + off) / step - 1e-9)), int(np.floor((hi_x + off) / step + 1e-9))
        for k in range(k0, k1 + 1):
            pos = k * step - off
            if vals and pos - vals[-1] < 0.5 * step:
                continue  # too close to the last tick before a break
            vals.append(pos)
            texts.append(_fmt_tick(k * step, step, unit))
    return vals, texts


# ------------------------------------------------------------------------------------ timeline
_MARKER_KINDS = {
    "sync": ("host sync", "triangle-down", "#ff7f0e"),
    "compile": ("compile start", "star", "#e377c2"),
    "oom": ("OOM", "x", "#d62728"),
}
#: Colour of host launch spans and of the host's waits at syncs.
LAUNCH_COLOR = "#9ecae1"
WAIT_COLOR = "rgba(255,127,14,0.55)"
#: Queue-depth line colour per device.
QUEUE_COLORS = ("#d62728", "#9467bd", "#8c564b", "#e377c2")
#: At most this many launch -> kernel links are drawn (those of the kernels drawn one by one, in time
#: order); the widget draws the clicked kernel's link as an arrow whatever the count.
MAX_FLOWS = 400
#: Thickness of a kernel's bar, in lanes.
BAR_THICKNESS = 0.7
#: A bar is drawn at least this many pixels wide (its hover and details give the measured duration).
MIN_BAR_PX = 2.0


def _group_key(e: KernelEvent, color_by: str) -> tuple[str, str, bool]:
    """(legend name, colour, compiled) of an event."""
    compiled = e.is_compiled
    if color_by == "subgraph":
        if compiled:
            return f"subgraph {e.subgraph}", _SUBGRAPH_COLORS[e.subgraph % len(_SUBGRAPH_COLORS)], True
        fam = "dma" if e.kind == "dma" else "eager"
        return fam, FAMILIES["dma"] if fam == "dma" else _EAGER_COLOR, False
    fam = op_family(e.name, e.kind)
    return (f"{fam} (compiled)" if compiled else fam), FAMILIES[fam], compiled


def _launch_hover(e: KernelEvent, t0: int) -> str:
    """Hover text of a kernel's host launch span."""
    rows = [
        f"<b>launch of {_hover_text(e.name)}</b>",
        f"host: {_fmt_ns(e.host_end_ns - e.host_start_ns)}, {_fmt_ns(e.host_start_ns - t0)} after the first event",
        f"runs on: {_hover_text(lane_label(e.device, e.engine, e.stream))}",
        f"queued: {_fmt_ns(max(e.start_ns - e.host_end_ns, 0))} between launch and start",
        f"kernel: {_fmt_ns(e.dur_ns)}",
        f"source: {_hover_text(event_location(e) or 'unknown')}",
    ]
    return "<br>".join(rows)


def _window_steps(t: np.ndarray, depth: np.ndarray, t0: int, t1: int, pixels: int) -> tuple[np.ndarray, np.ndarray]:
    """The steps of ``(t, depth)`` inside ``[t0, t1]`` (with the level in force at ``t0``), at most about
    two points per pixel: where a pixel column holds several steps, its highest level is kept."""
    if not len(t):
        return t, depth
    i0 = max(int(np.searchsorted(t, t0, side="right")) - 1, 0)
    i1 = int(np.searchsorted(t, t1, side="right"))
    t, depth = t[i0:i1], depth[i0:i1]
    if len(t) > 2 * pixels:
        px = max((t1 - t0) / pixels, 1.0)
        bins = ((t - t0) // px).astype(np.int64)
        first = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
        depth = np.maximum.reduceat(depth, first)
        t = t[first]
    return t, depth


def _scatter(webgl: bool, **kw: Any) -> go.Scatter | go.Scattergl:
    return go.Scattergl(**kw) if webgl else go.Scatter(**kw)


def _bars(x0: np.ndarray, x1: np.ndarray, min_w: float, **kw: Any) -> go.Bar:
    """Horizontal bars from ``x0`` to ``x1`` (axis µs), hoverable and clickable anywhere on them."""
    return go.Bar(base=x0, x=np.maximum(x1 - x0, min_w), orientation="h", width=BAR_THICKNESS,
                  hovertemplate="%{hovertext}<extra></extra>", **kw)


def timeline_figure(
    events: Trace | Iterable[KernelEvent] | EventColumns,
    *,
    color_by: str = "family",
    profile: str | None = None,
    max_boxes: int = 6000,
    pixels: int = 1200,
    window: tuple[int, int] | None = None,
    render: str = "auto",
    rangeslider: bool = False,
    title: str | None = None,
    width: int | None = None,
    axis: TimeAxis | None = None,
) -> go.Figure:
    """Kernel timeline: lanes per device x engine plus a host lane, markers for syncs, compiles, OOMs.

    Each kernel (or merged run of sub-pixel kernels, see :func:`lod_aggregate`) is a horizontal bar
    (``go.Bar`` with ``base``), so hovering or clicking anywhere on it shows it. Long idle stretches are
    collapsed into marked breaks of the x axis (:func:`time_axis`); the tick labels and every hover give
    measured time. An invisible two-point ``extent`` trace spans the whole trace, so double-click,
    "Reset axes", "Autoscale" and the range slider always reach the full view, even when the drawn
    bars are those of a zoomed window.

    Args:
        events: a :class:`Trace` (its profile names the estimates), events, or :class:`EventColumns`.
        color_by: 'family' (op family; compiled kernels get their own hatched '(compiled)' traces) or
            'subgraph' (one colour per compiled subgraph, eager grey).
        profile: device profile the roofline estimates refer to (default: the trace's).
        max_boxes: upper bound on the boxes drawn; the level of detail is coarsened until it holds.
        pixels: assumed plot width for the level of detail.
        window: ``(t0, t1)`` in the events' ns to draw (default: everything).
        render: marker traces (syncs, compile starts, OOMs): 'auto' (WebGL above
            :data:`WEBGL_THRESHOLD` markers), 'svg' or 'webgl'. Bars are always SVG.
        rangeslider: show a range slider under the x axis.
        width: figure width in pixels (None: fill the container).
        axis: a prebuilt :func:`time_axis` of ``events`` (default: computed).

    The figure's ``layout.meta`` holds ``{"t0_ns", "lanes", "num_events", "num_boxes", "merged",
    "breaks", "x_end"}``. Every hover trace's ``customdata`` is ``[seq, index]`` for an event (index
    into the events) or ``[-1, -(j + 1)]`` for merged box ``j``.

    Raises:
        ValueError: unknown ``color_by`` or ``render``, ``max_boxes`` < 1.
    """
    if color_by not in ("family", "subgraph"):
        raise ValueError(f"color_by must be 'family' or 'subgraph', got {color_by!r}")
    if render not in ("auto", "svg", "webgl"):
        raise ValueError(f"render must be 'auto', 'svg' or 'webgl', got {render!r}")
    if max_boxes < 1:
        raise ValueError(f"max_boxes must be >= 1, got {max_boxes}")
    if profile is None and isinstance(events, Trace):
        profile = events.profile
    cols = events if isinstance(events, EventColumns) else EventColumns.build(events)
    ax = axis if axis is not None else time_axis(cols)
    evs = cols.events
    t0 = cols.t0
    box_mask = ~cols.kind_mask("sync", "oom")
    t0w, t1w = window if window is not None else (t0, t0 + ax.span_ns)
    # level of detail in AXIS pixels: a collapsed break takes few pixels, so scale the pixel count
    xw0, xw1 = ax.x([t0w, t1w]).tolist()
    axis_ns = max((xw1 - xw0) * 1e3, 1e-9)
    scale = max((t1w - t0w) / axis_ns, 1e-9)
    lod = lod_aggregate(cols, t0w, t1w, max(1, round(pixels * scale)), mask=box_mask)
    px = pixels
    while lod.num_boxes > max_boxes and px > 1:
        px = max(1, int(px * max_boxes / lod.num_boxes * 0.9))
        lod = lod_aggregate(cols, t0w, t1w, max(1, round(px * scale)), mask=box_mask)
    nlanes = len(cols.lanes)
    # a bar is at least MIN_BAR_PX wide; a window of no length (one kernel of zero duration) counts as 1 us,
    # else its bar was 0 wide and nothing was drawn
    min_w = MIN_BAR_PX * ((xw1 - xw0) if xw1 > xw0 else 1.0) / max(pixels, 1)

    groups: dict[tuple[str, str, bool], list[int]] = {}
    for i in lod.singles.tolist():
        groups.setdefault(_group_key(evs[i], color_by), []).append(i)

    def order(key: tuple[str, str, bool]) -> tuple[int, str]:
        base = key[0].replace(" (compiled)", "")
        fams = list(FAMILIES)
        return (fams.index(base) if base in fams else len(fams), key[0])

    traces: list[Any] = []
    for key in sorted(groups, key=order):
        name, color, compiled = key
        gids = np.asarray(groups[key], dtype=np.int64)
        marker: dict[str, Any] = {"color": color, "line": {"width": 0}}
        if compiled:
            marker = {"color": color, "line": {"width": 1, "color": "#222"},
                      "pattern": {"shape": "/", "fgcolor": "rgba(255,255,255,0.6)", "size": 6}}
        traces.append(_bars(
            ax.x(cols.start[gids]), ax.x(cols.end[gids]), min_w, y=cols.lane[gids].astype(float), name=name,
            legendgroup=name, marker=marker,
            hovertext=[_hover_html(event_details(evs[i], profile, t0)) for i in gids.tolist()],
            customdata=np.column_stack([[evs[i].seq for i in gids.tolist()], gids]),
            meta={"role": "hover", "compiled": compiled},
        ))
    if len(lod.agg_count):
        k = len(lod.agg_count)
        traces.append(_bars(
            ax.x(lod.agg_start), ax.x(lod.agg_end), min_w, y=lod.agg_lane.astype(float), name="merged (zoom in)",
            legendgroup="merged", marker={"color": FAMILIES["merged"], "line": {"width": 0}},
            hovertext=[_agg_hover(cols, lod, j) for j in range(k)],
            customdata=np.column_stack([np.full(k, -1), -(np.arange(k) + 1)]),
            meta={"role": "hover", "compiled": False},
        ))
    host_y = float(cols.host_lane)
    flows_drawn = 0
    n_launches = 0
    queue_devices: list[int] = []
    if cols.is_async:
        launch_px = max(1, round(px * scale))
        lcols = cols.launch_columns()
        llod = lod_aggregate(lcols, t0w, t1w, launch_px, mask=cols.launched)
        n_launches = llod.total
        lids = llod.singles
        if len(lids):
            traces.append(_bars(
                ax.x(lcols.start[lids]), ax.x(lcols.end[lids]), min_w, y=np.full(len(lids), host_y), name="host launch",
                legendgroup="host launch", marker={"color": LAUNCH_COLOR, "line": {"width": 0}},
                hovertext=[_launch_hover(evs[i], t0) for i in lids.tolist()],
                customdata=np.column_stack([[evs[i].seq for i in lids.tolist()], lids]),
                meta={"role": "launch"},
            ))
        if len(llod.agg_count):
            k = len(llod.agg_count)
            traces.append(_bars(
                ax.x(llod.agg_start), ax.x(llod.agg_end), min_w, y=np.full(k, host_y), name="host launches (merged)",
                legendgroup="host launch", marker={"color": LAUNCH_COLOR, "line": {"width": 1, "color": "#555"}},
                hovertext=[f"<b>{int(llod.agg_count[j]):,} launches merged</b> (zoom in to see each)<br>host lane, "
                           f"span {_fmt_ns(int(llod.agg_end[j] - llod.agg_start[j]))}" for j in range(k)],
                customdata=np.column_stack([np.full(k, -1), -(np.arange(k) + 1)]), meta={"role": "launch"},
            ))
        # the host's waits: a bar for the time it waited (the marker below names the line)
        waits = np.flatnonzero(cols.kind_mask("sync") & (cols.end > cols.start) & (cols.end >= t0w)
                               & (cols.start <= t1w))[:max_boxes]
        if len(waits):
            traces.append(_bars(
                ax.x(cols.start[waits]), ax.x(cols.end[waits]), min_w, y=cols.lane[waits].astype(float),
                name="host wait", legendgroup="host sync", marker={"color": WAIT_COLOR, "line": {"width": 0}},
                hovertext=[_hover_html(event_details(evs[i], profile, t0)) for i in waits.tolist()],
                customdata=np.column_stack([[evs[i].seq for i in waits.tolist()], waits]),
                meta={"role": "hover", "compiled": False},
            ))
        # launch -> kernel links for the kernels drawn one by one
        linked = [i for i in lod.singles.tolist() if cols.launched[i]][:MAX_FLOWS]
        if linked:
            li = np.asarray(linked, dtype=np.int64)
            x_from, x_to = ax.x(cols.host_end[li]), ax.x(cols.start[li])  # type: ignore[index]
            y_to = cols.lane[li].astype(float)
            fx: list[float | None] = []
            fy: list[float | None] = []
            for a, b, y in zip(x_from.tolist(), x_to.tolist(), y_to.tolist()):
                fx += [a, b, None]
                fy += [host_y, y, None]
            traces.append(go.Scatter(x=fx, y=fy, mode="lines", name="launch → kernel", hoverinfo="skip",
                                     line={"color": "rgba(90,90,90,0.45)", "width": 1, "dash": "dot"},
                                     meta={"role": "flow", "count": len(linked)}))
            flows_drawn = len(linked)
        for d, (qt, qdepth) in queue_depth_steps(cols).items():
            qx, qy = _window_steps(qt, qdepth, t0w, t1w, pixels)
            if not len(qx):
                continue
            queue_devices.append(d)
            traces.append(go.Scatter(
                x=ax.x(qx), y=qy, mode="lines", yaxis="y2",
                line={"shape": "hv", "width": 1.5, "color": QUEUE_COLORS[d % len(QUEUE_COLORS)]},
                name=f"queue depth {device_name(d)}", hovertemplate="queue depth %{y}<extra>" + device_name(d)
                + "</extra>", meta={"role": "queue", "device": d},
            ))
    # instant markers: syncs, OOMs (compiles are bars and also get a star)
    mk_idx = np.nonzero(cols.kind_mask(*_MARKER_KINDS))[0]
    if window is not None and len(mk_idx):
        mk_idx = mk_idx[(cols.end[mk_idx] >= window[0]) & (cols.start[mk_idx] <= window[1])]
    n_markers = 0
    marker_traces: list[tuple[str, list[int]]] = []
    for kind in _MARKER_KINDS:
        ids = [i for i in mk_idx.tolist() if evs[i].kind == kind]
        if len(ids) > max_boxes:  # keep the payload bounded: one marker per pixel column
            arr = np.asarray(ids, dtype=np.int64)
            bins = ((cols.start[arr] - cols.start[arr].min()) / max(lod.pixel_ns, 1e-9)).astype(np.int64)
            _, first = np.unique(bins * (nlanes + 1) + cols.lane[arr], return_index=True)
            ids = arr[np.sort(first)].tolist()
        if ids:
            marker_traces.append((kind, ids))
            n_markers += len(ids)
    webgl = render == "webgl" or (render == "auto" and n_markers > WEBGL_THRESHOLD)
    oom_x: list[float] = []
    for kind, ids in marker_traces:
        label, symbol, color = _MARKER_KINDS[kind]
        xs_m = ax.x(np.asarray([evs[i].start_ns for i in ids], dtype=np.int64)).tolist()
        if kind == "oom":
            oom_x.extend(xs_m)
        traces.append(
            _scatter(
                webgl, x=xs_m, y=[float(cols.lane[i]) for i in ids], mode="markers", name=label,
                marker={"symbol": symbol, "size": 13, "color": color, "line": {"width": 1, "color": "#333"}},
                hovertext=[_hover_html(event_details(evs[i], profile, t0)) for i in ids],
                hovertemplate="%{hovertext}<extra></extra>",
                customdata=[[evs[i].seq, i] for i in ids], meta={"role": "marker", "kind": kind},
            )
        )
    # the whole trace's extent: autorange (double-click, Reset axes, Autoscale, range slider) sees it
    traces.append(go.Scatter(x=[0.0, ax.end_x], y=[0.0, 0.0], mode="markers", marker={"size": 1, "opacity": 0},
                             hoverinfo="skip", showlegend=False, name="extent", meta={"role": "extent"}))
    fig = go.Figure(traces)
    for x in oom_x[:50]:
        fig.add_vline(x=x, line={"color": "#d62728", "dash": "dot", "width": 1})
    dropped_at = cols.unrecorded
    for bs, be in ax.breaks:
        x0, x1 = ax.x([bs, be]).tolist()
        fig.add_vrect(x0=x0, x1=x1, fillcolor="rgba(110,110,110,0.13)", line={"width": 1, "dash": "dot",
                      "color": "#888"}, layer="below")
        # a stretch mostly inside what a bounded recording dropped: nothing is known of it, it is not idle
        dropped = dropped_at is not None and 2 * (min(be, dropped_at[1]) - max(bs, dropped_at[0])) > be - bs
        label = f"not recorded {_fmt_ns(be - bs)} (events dropped)" if dropped else f"idle {_fmt_ns(be - bs)}"
        fig.add_annotation(x=(x0 + x1) / 2, y=0.5, xref="x", yref="paper", text=label,
                           textangle=-90, showarrow=False, font={"size": 11, "color": "#555"},
                           bgcolor="rgba(255,255,255,0.7)")
    queue_px = 120 if queue_devices else 0
    height = max(260, 100 + 40 * nlanes + (110 if rangeslider else 0) + queue_px)
    xaxis: dict[str, Any] = {"title": {"text": "time since first event (µs)"}, "showgrid": True, "zeroline": False,
                             "rangeslider": {"visible": rangeslider}}
    if ax.breaks:
        vals, texts = axis_ticks(ax, xw0 if window is not None else None, xw1 if window is not None else None)
        xaxis.update(tickmode="array", tickvals=vals, ticktext=texts,
                     title={"text": f"time since first event (shaded: {len(ax.breaks)} idle "
                                    f"stretch{'es' if len(ax.breaks) > 1 else ''} compressed)"})
    fig.update_layout(
        title=title,
        height=height,
        width=width,
        margin={"l": 140, "r": 20, "t": 80 if title else 60, "b": 40},
        hovermode="closest",
        hoverdistance=30,
        dragmode="zoom",
        barmode="overlay",
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0, "font": {"size": 11}},
        xaxis=xaxis,
        yaxis={"tickmode": "array", "tickvals": list(range(nlanes)), "ticktext": cols.lanes,
               "range": [nlanes - 0.5, -0.5], "fixedrange": True, "showgrid": False, "zeroline": False,
               **({"domain": [queue_px / (height - 100 - (110 if rangeslider else 0)) + 0.04, 1.0]}
                  if queue_devices else {})},
        meta={
            "t0_ns": t0,
            "lanes": cols.lanes,
            "num_events": len(evs),
            "num_boxes": lod.num_boxes,
            "merged": int(lod.agg_count.sum()) if len(lod.agg_count) else 0,
            "profile": profile,
            "renderer": "webgl" if webgl else "svg",
            "kinds": sorted(cols.kinds),
            "breaks": [[bs, be] for bs, be in ax.breaks],
            "x_end": ax.end_x,
            "async": cols.is_async,
            "launches": n_launches,
            "flows": flows_drawn,
            "queue_devices": queue_devices,
        },
        template="plotly_white",
    )
    if queue_devices:
        frac = queue_px / (height - 100 - (110 if rangeslider else 0))
        fig.update_layout(
            yaxis2={"domain": [0.0, frac], "title": {"text": "queue", "font": {"size": 11}}, "rangemode": "tozero",
                    "fixedrange": True, "anchor": "x", "showgrid": True, "zeroline": True},
            xaxis={"anchor": "y2"},
        )
    if window is not None:
        fig.update_xaxes(range=[xw0, xw1])
    return fig

# ------------------------------------------------------------------------------------ memory
def _device_traces(snapshot: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    if isinstance(snapshot, Mapping):
        return [list(t) for t in snapshot.get("device_traces", [])]
    return [list(snapshot)]  # one device's trace entries


def _device_entries(snapshot: Mapping[str, Any] | Sequence[Mapping[str, Any]], device: Any) -> list[Mapping[str, Any]]:
    """``device``'s history entries; a device the snapshot does not hold raises (an empty view of it
    would read as "nothing allocated"). A snapshot without ``device_traces`` holds the devices of its
    segments, and at least neuron:0."""
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"device must be an int, not {type(device).__name__}")
    traces = _device_traces(snapshot)
    n = len(traces)
    if isinstance(snapshot, Mapping) and "device_traces" not in snapshot:
        n = max([int(s.get("device", 0)) + 1 for s in snapshot.get("segments", [])] + [1])
    if not 0 <= device < n:
        held = "neuron:0" if n == 1 else f"neuron:0 and neuron:{n - 1}" if n == 2 else f"neuron:0 to neuron:{n - 1}"
        raise ValueError(f"neuron:{device} is not in this snapshot: it holds {held}")
    return traces[device] if device < len(traces) else []


def memory_timeline(
    snapshot: Mapping[str, Any] | Sequence[Mapping[str, Any]], device: int = 0
) -> dict[str, Any]:
    """Allocated and reserved bytes after each allocator action of ``device``, from ``device_traces``.

    The series end at the snapshot's current state (the live blocks and segments in
    ``segments``), so memory allocated before history recording began is counted as a baseline.
    A list of trace entries (one device's history) is accepted too; its baseline is 0.

    Returns ``{"time_us", "allocated", "reserved", "actions", "peak_allocated", "peak_index",
    "peak_reserved", "ooms": [{"time_us", "index", "allocated", "device_free", "size"}]}``; entry ``i``
    of each series is the state after the ``i``-th action.
    """
    entries = _device_entries(snapshot, device)
    d_alloc = np.zeros(len(entries), dtype=np.int64)
    d_res = np.zeros(len(entries), dtype=np.int64)
    for i, ent in enumerate(entries):
        act, size = ent.get("action"), int(ent.get("size", 0))
        if act == "alloc":
            d_alloc[i] = size
        elif act == "free_completed":
            d_alloc[i] = -size
        elif act in ("segment_alloc", "segment_map"):
            d_res[i] = size
        elif act in ("segment_free", "segment_unmap"):
            d_res[i] = -size
    base_alloc = base_res = 0
    if isinstance(snapshot, Mapping):
        segs = [s for s in snapshot.get("segments", []) if int(s.get("device", 0)) == device]
        end_alloc = sum(int(b["size"]) for s in segs for b in s.get("blocks", []) if b.get("state") == "active_allocated")
        end_res = sum(int(s["total_size"]) for s in segs)
        base_alloc = end_alloc - int(d_alloc.sum())
        base_res = end_res - int(d_res.sum())
    allocated = base_alloc + np.cumsum(d_alloc)
    reserved = base_res + np.cumsum(d_res)
    ooms = [
        {"time_us": int(ent.get("time_us", 0)), "index": i, "allocated": int(allocated[i]),
         "device_free": int(ent.get("device_free", 0)), "size": int(ent.get("size", 0))}
        for i, ent in enumerate(entries) if ent.get("action") == "oom"
    ]
    peak_index = int(np.argmax(allocated)) if len(allocated) else -1
    return {
        "time_us": [int(ent.get("time_us", i)) for i, ent in enumerate(entries)],
        "allocated": allocated.tolist(),
        "reserved": reserved.tolist(),
        "actions": [str(ent.get("action", "")) for ent in entries],
        "peak_allocated": int(allocated.max()) if len(allocated) else base_alloc,
        "peak_index": peak_index,
        "peak_reserved": int(reserved.max()) if len(reserved) else base_res,
        "ooms": ooms,
    }


def memory_figure(
    snapshot: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    *,
    devices: Iterable[int] | None = None,
    at_index: int | None = None,
) -> go.Figure:
    """Allocated and reserved memory over time per device (MiB), the peak marked, OOMs marked.

    ``layout.meta["devices"][str(d)]`` holds ``peak_allocated`` / ``peak_reserved`` (bytes) and the
    number of OOMs; ``at_index`` draws a vertical line at that moment of device 0's history.
    """
    traces = _device_traces(snapshot)
    devs = list(devices) if devices is not None else [d for d, t in enumerate(traces) if t] or [0]
    fig = go.Figure()
    meta: dict[str, Any] = {}
    t_origin = min((int(t[0].get("time_us", 0)) for t in traces if t), default=0)
    for d in devs:
        tl = memory_timeline(snapshot, d)
        x = [(t - t_origin) / 1e3 for t in tl["time_us"]]
        mib = 1 / 2**20
        fig.add_trace(go.Scatter(x=x, y=[v * mib for v in tl["reserved"]], mode="lines", line={"shape": "hv"},
                                 name=f"neuron:{d} reserved", hovertemplate="%{y:.2f} MiB reserved<extra></extra>"))
        fig.add_trace(go.Scatter(x=x, y=[v * mib for v in tl["allocated"]], mode="lines", line={"shape": "hv"},
                                 fill="tozeroy", name=f"neuron:{d} allocated",
                                 customdata=tl["actions"],
                                 hovertemplate="%{y:.2f} MiB allocated after %{customdata}<extra></extra>"))
        if tl["peak_index"] >= 0:
            i = tl["peak_index"]
            fig.add_trace(go.Scatter(
                x=[x[i]], y=[tl["peak_allocated"] * mib], mode="markers+text", name=f"neuron:{d} peak",
                marker={"symbol": "triangle-down", "size": 12, "color": "#d62728"},
                text=[f"peak {_fmt_bytes(tl['peak_allocated'])}"], cliponaxis=False,
                textposition="top left" if i > len(x) // 2 else "top right",
                hovertemplate=f"peak allocated on neuron:{d}: {_fmt_bytes(tl['peak_allocated'])}<extra></extra>",
            ))
        if tl["ooms"]:
            fig.add_trace(go.Scatter(
                x=[(o["time_us"] - t_origin) / 1e3 for o in tl["ooms"]], y=[o["allocated"] * mib for o in tl["ooms"]],
                mode="markers", name=f"neuron:{d} OOM", marker={"symbol": "x", "size": 14, "color": "#d62728"},
                hovertext=[f"OOM: requested {_fmt_bytes(o['size'])}, device free {_fmt_bytes(o['device_free'])}"
                           for o in tl["ooms"]],
                hovertemplate="%{hovertext}<extra></extra>",
            ))
        meta[str(d)] = {"peak_allocated": tl["peak_allocated"], "peak_reserved": tl["peak_reserved"],
                        "ooms": len(tl["ooms"]), "entries": len(x)}
        if at_index is not None and d == devs[0] and 0 <= at_index < len(x):
            fig.add_vline(x=x[at_index], line={"color": "#333", "dash": "dash"})
    fig.update_layout(
        height=320, margin={"l": 60, "r": 20, "t": 30, "b": 40}, template="plotly_white",
        xaxis={"title": {"text": "time since first recorded action (ms)"}},
        yaxis={"title": {"text": "MiB"}}, hovermode="x unified", meta={"devices": meta},
    )
    return fig




def _cell_mapper() -> Any:
    """What names a notebook location: the recorder's source mapper (installed by ``%load_ext
    torchneuron_lab``), else -- the widgets used in a notebook without the extension -- a
    :class:`~torchneuron_lab.extension.cells.CellMapper` of the running IPython shell, so an owner reads
    'cell [3], line 2' rather than '/tmp/ipykernel_.../....py'. None outside IPython."""
    import sys

    rec = sys.modules.get("torchneuron_lab.device.recorder")
    mapper = getattr(rec, "_source_mapper", None) if rec is not None else None
    if mapper is not None:
        return mapper
    ipy = sys.modules.get("IPython")
    shell = ipy.get_ipython() if ipy is not None and hasattr(ipy, "get_ipython") else None
    if shell is None:
        return None
    from torchneuron_lab.extension.cells import CellMapper

    return CellMapper(shell)


def _user_frame(frames: Sequence[Mapping[str, Any]], mapper: Any = None) -> str:
    """First frame (innermost first) outside torch, our package and IPython, as its notebook cell
    ('cell [3], line 2', through ``mapper``) or 'file:line in func'."""
    for fr in frames:
        fn = str(fr.get("filename", ""))
        if is_internal(fn):
            continue
        line = int(fr.get("line", 0) or 0)
        mapped = mapper(fn, line) if mapper is not None else None
        return str(mapped) if mapped else f"{fn}:{line} in {fr.get('name', '')}"
    if frames:
        fr = frames[0]
        return f"{fr.get('filename', '')}:{fr.get('line', 0)} in {fr.get('name', '')}"
    return "unknown (allocated before allocator history was recorded with context)"


def _state_at(snapshot: Mapping[str, Any], device: int, index: int | None) -> tuple[dict[int, int], dict[int, dict[str, Any]]]:
    """Segments ``{addr: size}`` and live blocks ``{addr: {size, frames}}`` after action ``index``
    (None: now), undoing later actions of ``device_traces`` from the current state."""
    entries = _device_entries(snapshot, device)
    segs = {int(s["address"]): int(s["total_size"]) for s in snapshot.get("segments", [])
            if int(s.get("device", 0)) == device}
    blocks = {int(b["address"]): {"size": int(b["size"]), "frames": list(b.get("frames", []))}
              for s in snapshot.get("segments", []) if int(s.get("device", 0)) == device
              for b in s.get("blocks", []) if b.get("state") == "active_allocated"}
    if index is None:
        return segs, blocks
    alloc_frames: dict[int, list[Any]] = {}
    for ent in entries[: index + 1]:
        if ent.get("action") == "alloc":
            alloc_frames[int(ent["addr"])] = list(ent.get("frames", []))
    for ent in reversed(entries[index + 1:]):
        act, addr, size = ent.get("action"), int(ent.get("addr", 0)), int(ent.get("size", 0))
        if act == "alloc":
            blocks.pop(addr, None)
        elif act == "free_completed":
            blocks[addr] = {"size": size, "frames": alloc_frames.get(addr, list(ent.get("frames", [])))}
        elif act in ("segment_alloc", "segment_map"):
            segs.pop(addr, None)
        elif act in ("segment_free", "segment_unmap"):
            segs[addr] = size
    return segs, blocks


def top_allocations(
    snapshot: Mapping[str, Any], k: int = 10, *, device: int = 0, at_index: int | None = None
) -> list[dict[str, Any]]:
    """The ``k`` largest live blocks (at ``at_index`` of the history, or now): ``address``, ``size``,
    ``source`` (allocating line)."""
    _, blocks = _state_at(snapshot, device, at_index)
    mapper = _cell_mapper()
    rows = [{"address": a, "size": b["size"], "source": _user_frame(b["frames"], mapper)} for a, b in blocks.items()]
    rows.sort(key=lambda r: (-r["size"], r["address"]))
    return rows[:k]


def segment_map_figure(
    snapshot: Mapping[str, Any], *, device: int = 0, at_index: int | None = None
) -> go.Figure:
    """Segment/block map of ``device``: one row per segment, each live block a bar at its offset,
    free space grey; hovering a block shows its size and the source line that allocated it.

    ``at_index`` shows the state after that action of ``device_traces`` (None: now).
    ``layout.meta`` holds ``{"segments", "blocks", "allocated_bytes", "reserved_bytes"}``.
    """
    segs, blocks = _state_at(snapshot, device, at_index)
    mapper = _cell_mapper()
    seg_list = sorted(segs.items())
    labels = [f"seg {i} ({_fmt_bytes(size)})" for i, (_, size) in enumerate(seg_list)]
    mib = 1 / 2**20
    free_x, free_base, free_y = [], [], []
    bx, bbase, by, btext = [], [], [], []
    for label, (addr, size) in zip(labels, seg_list):
        free_x.append(size * mib)
        free_base.append(0.0)
        free_y.append(label)
        for baddr, b in sorted(blocks.items()):
            if addr <= baddr < addr + size:
                bx.append(b["size"] * mib)
                bbase.append((baddr - addr) * mib)
                by.append(label)
                btext.append(f"block {hex(baddr)}<br>size: {_fmt_bytes(b['size'])}<br>"
                             f"allocated at: {_hover_text(_user_frame(b['frames'], mapper))}")
    fig = go.Figure()
    fig.add_trace(go.Bar(x=free_x, base=free_base, y=free_y, orientation="h", name="free (cached)",
                         marker={"color": "#e5e5e5"}, hovertemplate="segment %{y}<extra></extra>"))
    fig.add_trace(go.Bar(x=bx, base=bbase, y=by, orientation="h", name="allocated block",
                         marker={"color": "#1f77b4", "line": {"color": "white", "width": 1}},
                         hovertext=btext, hovertemplate="%{hovertext}<extra></extra>"))
    fig.update_layout(
        barmode="overlay", height=max(200, 60 + 28 * len(labels)), template="plotly_white",
        margin={"l": 120, "r": 20, "t": 30, "b": 40}, xaxis={"title": {"text": "offset in segment (MiB)"}},
        yaxis={"autorange": "reversed"},
        meta={"segments": len(seg_list), "blocks": len(bx),
              "allocated_bytes": int(sum(b["size"] for a, b in blocks.items()
                                         if any(s <= a < s + z for s, z in seg_list))),
              "reserved_bytes": int(sum(segs.values()))},
    )
    return fig


# ------------------------------------------------------------------------------------ compiler views
def _as_dict(rec: Any) -> dict[str, Any]:
    if isinstance(rec, Mapping):
        return dict(rec)
    if hasattr(rec, "as_dict"):
        return dict(rec.as_dict())
    raise TypeError(f"expected a dict or a record with as_dict(), got {type(rec).__name__}")


def subgraph_rows(records: Iterable[Any]) -> list[dict[str, Any]]:
    """One row per compiled subgraph: ``id``, ``name``, ``kind``, ``compile_id``, ``ops``,
    ``kernels``, ``fallbacks``, ``compile_ms`` (total measured), ``calls``, ``guards``, ``location``."""
    rows = []
    for rec in records:
        d = _as_dict(rec)
        ms = [v for v in (d.get("compile_ms") or {}).values() if v is not None]
        src = d.get("source") or []
        rows.append({
            "id": d.get("id"), "name": d.get("name", ""), "kind": d.get("kind", ""),
            "compile_id": d.get("compile_id", ""), "ops": sum((d.get("op_counts") or {}).values()),
            "kernels": len(d.get("kernels") or []), "fallbacks": len(d.get("fallbacks") or []),
            "compile_ms": round(sum(ms), 3), "calls": d.get("calls", 0), "guards": len(d.get("guards") or []),
            "location": (src[0].get("location") or f"{src[0].get('filename')}:{src[0].get('line')}") if src else "",
        })
    return rows


def subgraph_table_figure(records: Iterable[Any]) -> go.Figure:
    """A ``go.Table`` of :func:`subgraph_rows`."""
    rows = subgraph_rows(records)
    keys = ["id", "name", "kind", "compile_id", "ops", "kernels", "fallbacks", "compile_ms", "calls", "guards", "location"]
    fig = go.Figure(go.Table(header={"values": keys}, cells={"values": [[r[k] for r in rows] for k in keys]}))
    fig.update_layout(height=80 + 30 * len(rows), margin={"l": 10, "r": 10, "t": 10, "b": 10}, meta={"rows": len(rows)})
    return fig


def graph_break_rows(breaks: Iterable[Any]) -> list[dict[str, Any]]:
    """One row per graph break: ``reason``, ``location`` (cell/line), ``function``, ``count``, ``hints``."""
    rows = []
    for b in breaks:
        d = _as_dict(b)
        rows.append({"reason": d.get("reason", ""), "location": d.get("location") or f"{d.get('filename')}:{d.get('line')}",
                     "function": d.get("function") or "", "count": d.get("count", 1),
                     "hints": list(d.get("hints") or []), "explanation": d.get("explanation", "")})
    return rows


def graph_breaks_figure(breaks: Iterable[Any]) -> go.Figure:
    """A ``go.Table`` of :func:`graph_break_rows`."""
    rows = graph_break_rows(breaks)
    keys = ["reason", "location", "function", "count"]
    fig = go.Figure(go.Table(header={"values": keys}, cells={"values": [[r[k] for r in rows] for k in keys]}))
    fig.update_layout(height=80 + 30 * len(rows), margin={"l": 10, "r": 10, "t": 10, "b": 10}, meta={"rows": len(rows)})
    return fig


#: plotly.js's default topojson location (geo maps only, never drawn here): pointed at a relative folder so a
#: written file names no remote host.
_CDN_TOPOJSON = '"https://cdn.plot.ly/un/"'


def _displayable_tree(obj: Any) -> Any:
    """``obj`` (a figure's dict) with every string made :func:`displayable`."""
    if isinstance(obj, str):
        return displayable(obj)
    if isinstance(obj, dict):
        return {displayable(str(k)): _displayable_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_displayable_tree(v) for v in obj]
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "OU":
        return [_displayable_tree(v) for v in obj.tolist()]
    return obj


def save_html(fig: Any, path: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Write ``fig`` (a Figure, FigureWidget, or one of :mod:`.timeline`'s widgets) as one offline HTML file.

    plotly.js is embedded (``include_plotlyjs=True``); nothing is loaded from a CDN. The only URL
    inside plotly.js -- the default topojson location for geo maps, which these figures never draw
    -- is pointed at a relative folder so the file references no remote host at all.

    The file is written next to itself and renamed into place (a failure leaves the old file as it was);
    a path ending in '.gz' is gzip-compressed. A lone surrogate (from a file name that is not valid UTF-8)
    is written as a backslash escape in the title, and in the figure where plotly's JSON engine refuses it.
    """
    if not hasattr(fig, "figure") and callable(getattr(fig, "static_html", None)):
        # MemoryWidget, SubgraphWidget: their static view (summary, figures, tables) as one page
        from . import timeline as _timeline

        sent = _timeline._STATIC["plotlyjs_sent"]
        _timeline._STATIC["plotlyjs_sent"] = False  # plotly.js inlined in this file, once
        try:
            body = str(fig.static_html())
        finally:
            _timeline._STATIC["plotlyjs_sent"] = sent
        head = f"<title>{html.escape(displayable(title))}</title>" if title else ""
        page = f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">{head}</head><body>{body}</body></html>\n"
        page_data = page.encode("utf-8", errors="backslashreplace")
        return write_atomically(path, lambda fh: fh.write(page_data))
    figure = getattr(fig, "figure", fig)
    if not isinstance(figure, (BaseFigure, Mapping)):
        raise TypeError(f"save_html takes a plotly Figure, a FigureWidget or one of the lab's widgets, got "
                        f"{type(fig).__name__}")
    if not isinstance(figure, go.Figure):  # FigureWidget is a BaseFigure but not a go.Figure
        figure = go.Figure(figure)
    options: dict[str, Any] = {"include_plotlyjs": True, "full_html": True, "include_mathjax": False,
                               "config": {"responsive": True, "displaylogo": False}}
    try:
        text = figure.to_html(**options)
    except (TypeError, UnicodeError):
        # orjson (plotly's JSON engine when installed) refuses a str with lone surrogates, e.g. a name a
        # user gave the figure from a file name that is not valid UTF-8; such text is written escaped
        text = pio.to_html(_displayable_tree(figure.to_dict()), validate=False, **options)
    text = text.replace(_CDN_TOPOJSON, '"topojson/"')
    if title:
        text = text.replace("<head>", f"<head><title>{html.escape(displayable(title))}</title>", 1)
    data = text.encode("utf-8", errors="replace")
    return write_atomically(path, lambda fh: fh.write(data))
