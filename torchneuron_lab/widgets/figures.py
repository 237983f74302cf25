"""Pure figure builders: plain event / snapshot / registry data in, ``plotly.graph_objects.Figure`` out.

Nothing here displays, prints, touches a device or keeps state; the widgets in :mod:`.timeline` wrap
these functions (STYLE habit 6). Inputs are the plain data of the other layers only (habit 5):

* :class:`~torchneuron_lab.tracing.KernelEvent` lists (or a :class:`~torchneuron_lab.tracing.Trace`);
* the ``torch.cuda``-format memory snapshot dict (``torch.neuron.memory._snapshot()``);
* subgraph records as dicts (``SubgraphRecord.as_dict()``) and graph breaks as dicts.

Timeline layout: one lane (y row) per ``device x engine`` in :data:`ENGINES` order, plus one ``host``
lane for host-side events (syncs). Each kernel is a thick horizontal line from start to end (bars as
lines, so the figure scales to WebGL) plus one marker at its middle that carries the hover text and
the click payload (``customdata``). Above :data:`WEBGL_THRESHOLD` points the traces are
``go.Scattergl``; below, SVG ``go.Scatter``.

Level of detail: :func:`lod_aggregate` merges runs of sub-pixel kernels of a lane into aggregate boxes
that carry their count; counts always add up to the events in the window (no kernel is lost). Times on
the x axis are microseconds since the trace's first event.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go

from torchneuron_lab.tracing import ENGINES, KernelEvent, Trace, device_name

__all__ = [
    "FAMILIES",
    "HOST_LANE",
    "LOD",
    "WEBGL_THRESHOLD",
    "EventColumns",
    "event_details",
    "graph_break_rows",
    "graph_breaks_figure",
    "lane_label",
    "lanes_of",
    "lod_aggregate",
    "memory_figure",
    "memory_timeline",
    "op_family",
    "segment_map_figure",
    "subgraph_rows",
    "subgraph_table_figure",
    "summary_text",
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
_BAR_WIDTH_PX = 14


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


def lane_label(device: int, engine: str) -> str:
    """'neuron:0 · tensor'; the host lane is 'host'."""
    if engine == "host" or device < 0:
        return HOST_LANE
    return f"{device_name(device)} · {engine}"


def _engine_key(engine: str) -> tuple[int, str]:
    return (ENGINES.index(engine), "") if engine in ENGINES else (len(ENGINES), engine)


def lanes_of(events: Iterable[KernelEvent]) -> list[str]:
    """Lane labels present in ``events``, in display order: devices ascending, engines in
    :data:`ENGINES` order, the host lane last."""
    return _lanes_from_keys({(e.device, e.engine) for e in events})


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

    @classmethod
    def build(cls, events: Trace | Iterable[KernelEvent]) -> EventColumns:
        evs = list(events.events if isinstance(events, Trace) else events)
        n = len(evs)
        start = np.fromiter((e.start_ns for e in evs), dtype=np.int64, count=n)
        end = np.fromiter((e.end_ns for e in evs), dtype=np.int64, count=n)
        keys = [(e.device, e.engine) for e in evs]
        key_to_label = {k: lane_label(*k) for k in set(keys)}
        lanes = _lanes_from_keys(set(key_to_label))
        pos = {lab: i for i, lab in enumerate(lanes)}
        key_to_lane = {k: pos[lab] for k, lab in key_to_label.items()}
        lane = np.fromiter((key_to_lane[k] for k in keys), dtype=np.int32, count=n)
        kind_codes: dict[str, int] = {}
        kind = np.fromiter((kind_codes.setdefault(e.kind, len(kind_codes)) for e in evs), dtype=np.int8, count=n)
        t0 = int(start.min()) if n else 0
        return cls(evs, lanes, start, end, lane, kind, list(kind_codes), t0)

    def kind_mask(self, *kinds: str) -> np.ndarray:
        """Boolean mask of the events whose kind is one of ``kinds``."""
        codes = [i for i, k in enumerate(self.kinds) if k in kinds]
        return np.isin(self.kind, codes)


def _lanes_from_keys(keys: set[tuple[int, str]]) -> list[str]:
    dev = sorted({(d, g) for d, g in keys if g != "host" and d >= 0}, key=lambda k: (k[0], _engine_key(k[1])))
    labels = [lane_label(d, g) for d, g in dev]
    if any(g == "host" or d < 0 for d, g in keys):
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

    Returns ``{"num_events", "span_ns", "syncs", "sync_wait_ns", "ooms", "compiles",
    "new_signatures", "engines": {engine: {"count", "total_ns", "busy_ns"}},
    "lanes": {label: {"count", "busy_ns", "idle_ns", "gaps"}}, "idle_ns", "idle_gaps"}``, with the
    same definitions as :func:`torchneuron_lab.tracing.time_by_engine` and
    :func:`~torchneuron_lab.tracing.idle_gaps` (busy time is the union of a lane's intervals; gaps are
    strictly inside a lane's span).
    """
    cols = events if isinstance(events, EventColumns) else EventColumns.build(events)
    n = len(cols.events)
    busy_mask = cols.kind_mask(*_BUSY)
    sync_mask = cols.kind_mask("sync")
    out: dict[str, Any] = {
        "num_events": n,
        "span_ns": int(cols.end.max() - cols.start.min()) if n else 0,
        "syncs": int(sync_mask.sum()),
        "sync_wait_ns": int((cols.end[sync_mask] - cols.start[sync_mask]).sum()),
        "ooms": int(cols.kind_mask("oom").sum()),
        "compiles": int(cols.kind_mask("compile").sum()),
        "new_signatures": sum(1 for e in cols.events if e.new_signature) if n < 200_000 else None,
    }
    lanes: dict[str, dict[str, int]] = {}
    engines: dict[str, dict[str, int]] = {}
    idx = np.nonzero(busy_mask)[0]
    if len(idx):
        order = np.lexsort((cols.end[idx], cols.start[idx], cols.lane[idx]))
        idx = idx[order]
        lane, start, end = cols.lane[idx], cols.start[idx], cols.end[idx]
        bounds = np.nonzero(np.r_[True, lane[1:] != lane[:-1], True])[0]
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            s, e = start[a:b], end[a:b]
            run = np.maximum.accumulate(e)
            gaps = s[1:] - run[:-1]
            gaps = gaps[gaps > 0]
            span = int(run[-1] - s[0])
            label = cols.lanes[int(lane[a])]
            busy = span - int(gaps.sum())
            lanes[label] = {"count": b - a, "busy_ns": busy, "idle_ns": int(gaps.sum()), "gaps": len(gaps)}
            engine = label.split(" · ")[-1]
            row = engines.setdefault(engine, {"count": 0, "total_ns": 0, "busy_ns": 0})
            row["count"] += b - a
            row["total_ns"] += int((e - s).sum())
            row["busy_ns"] += busy
    order_e = sorted(engines, key=_engine_key)
    out["engines"] = {k: engines[k] for k in order_e}
    out["lanes"] = lanes
    out["idle_ns"] = sum(v["idle_ns"] for v in lanes.values())
    out["idle_gaps"] = sum(v["gaps"] for v in lanes.values())
    return out


def summary_text(summary: Mapping[str, Any]) -> str:
    """Plain-text rendering of :func:`timeline_summary` (the terminal fallback)."""
    lines = [
        (
            f"{summary['num_events']:,} events over {_fmt_ns(summary['span_ns'])}; "
            f"{summary['syncs']} host syncs (waited {_fmt_ns(summary['sync_wait_ns'])}), "
            f"{summary['idle_gaps']} idle gaps ({_fmt_ns(summary['idle_ns'])} idle), "
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


def event_details(e: KernelEvent, profile: str | None = None) -> dict[str, Any]:
    """The hover/details fields of one event as an ordered dict of label -> text."""
    d: dict[str, Any] = {
        "op": e.name,
        "kind": e.kind,
        "lane": lane_label(e.device, e.engine),
        "duration": _fmt_ns(e.dur_ns),
    }
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
    d["source"] = e.location or "unknown"
    d["subgraph"] = str(e.subgraph) if e.subgraph >= 0 else "eager"
    d["new signature"] = "yes (first seen: a NEFF compile on Trainium)" if e.new_signature else "no"
    if e.est_ns is not None:
        d["roofline estimate"] = f"{_fmt_ns(e.est_ns)} on {profile or 'the device profile'} (estimate, not measured)"
    d["seq"] = e.seq
    return d


def _hover_html(details: Mapping[str, Any]) -> str:
    head = f"<b>{html.escape(str(details['op']))}</b>"
    rows = [f"{html.escape(k)}: {html.escape(str(v))}" for k, v in details.items() if k != "op"]
    return "<br>".join([head, *rows])


def _agg_hover(cols: EventColumns, lod: LOD, j: int) -> str:
    first = cols.events[int(lod.agg_first[j])]
    last = cols.events[int(lod.agg_last[j])]
    span = int(lod.agg_end[j] - lod.agg_start[j])
    return (
        f"<b>{int(lod.agg_count[j]):,} events merged</b> (zoom in to see each)<br>"
        f"lane: {html.escape(cols.lanes[int(lod.agg_lane[j])])}<br>"
        f"span: {_fmt_ns(span)}, busy: {_fmt_ns(int(lod.agg_busy[j]))}<br>"
        f"first: {html.escape(first.name)}<br>last: {html.escape(last.name)}"
    )


# ------------------------------------------------------------------------------------ timeline
_MARKER_KINDS = {
    "sync": ("host sync", "triangle-down", "#ff7f0e"),
    "compile": ("compile start", "star", "#e377c2"),
    "oom": ("OOM", "x", "#d62728"),
}


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


def _scatter(webgl: bool, **kw: Any) -> go.Scatter | go.Scattergl:
    return go.Scattergl(**kw) if webgl else go.Scatter(**kw)


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
) -> go.Figure:
    """Kernel timeline: lanes per device x engine plus a host lane, markers for syncs, compiles, OOMs.

    Args:
        events: a :class:`Trace` (its profile names the estimates), events, or :class:`EventColumns`.
        color_by: 'family' (op family; compiled kernels get their own dashed '(compiled)' traces) or
            'subgraph' (one colour per compiled subgraph, eager grey).
        profile: device profile the roofline estimates refer to (default: the trace's).
        max_boxes: upper bound on the boxes drawn; the level of detail is coarsened until it holds.
        pixels: assumed plot width for the level of detail.
        window: ``(t0, t1)`` in the events' ns to draw (default: everything).
        render: 'auto' (WebGL above :data:`WEBGL_THRESHOLD` points), 'svg' or 'webgl'.
        rangeslider: show a range slider under the x axis.
        width: figure width in pixels (None: fill the container).

    The figure's ``layout.meta`` holds ``{"t0_ns", "lanes", "num_events", "num_boxes", "merged"}``.
    Every hover marker's ``customdata`` is ``[seq, index]`` for an event (index into the events) or
    ``[-1, -(j + 1)]`` for merged box ``j``.

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
    evs = cols.events
    box_mask = ~cols.kind_mask("sync", "oom")
    t0w, t1w = window if window is not None else (None, None)
    lod = lod_aggregate(cols, t0w, t1w, pixels, mask=box_mask)
    px = pixels
    while lod.num_boxes > max_boxes and px > 1:
        px = max(1, int(px * max_boxes / lod.num_boxes * 0.9))
        lod = lod_aggregate(cols, t0w, t1w, px, mask=box_mask)
    t0 = cols.t0
    nlanes = len(cols.lanes)
    n_points = lod.num_boxes * 4
    webgl = render == "webgl" or (render == "auto" and n_points > WEBGL_THRESHOLD)

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
        s = (cols.start[gids] - t0) / 1e3
        e_ = (cols.end[gids] - t0) / 1e3
        y = cols.lane[gids].astype(float)
        xs = np.column_stack([s, e_, np.full(len(gids), np.nan)]).ravel()
        ys = np.column_stack([y, y, np.full(len(gids), np.nan)]).ravel()
        line: dict[str, Any] = {"color": color, "width": _BAR_WIDTH_PX if not compiled else _BAR_WIDTH_PX - 4}
        if compiled and not webgl:
            line["dash"] = "dash"
        traces.append(
            _scatter(
                webgl, x=xs, y=ys, mode="lines", line=line, name=name, legendgroup=name,
                hoverinfo="skip", showlegend=True, meta={"role": "boxes"},
            )
        )
        texts = [_hover_html(event_details(evs[i], profile)) for i in gids.tolist()]
        traces.append(
            _scatter(
                webgl, x=(s + e_) / 2, y=y, mode="markers", name=name, legendgroup=name, showlegend=False,
                marker={"size": 9 if compiled else 6, "color": color, "symbol": "diamond" if compiled else "circle",
                        "opacity": 0.9 if compiled else 0.35, "line": {"width": 1, "color": "#222"} if compiled else {"width": 0}},
                hovertext=texts, hovertemplate="%{hovertext}<extra></extra>",
                customdata=np.column_stack([[evs[i].seq for i in gids.tolist()], gids]),
                meta={"role": "hover"},
            )
        )
    if len(lod.agg_count):
        s = (lod.agg_start - t0) / 1e3
        e_ = (lod.agg_end - t0) / 1e3
        y = lod.agg_lane.astype(float)
        nan = np.full(len(s), np.nan)
        traces.append(
            _scatter(
                webgl, x=np.column_stack([s, e_, nan]).ravel(), y=np.column_stack([y, y, nan]).ravel(),
                mode="lines", line={"color": FAMILIES["merged"], "width": _BAR_WIDTH_PX}, name="merged (zoom in)",
                legendgroup="merged", hoverinfo="skip", meta={"role": "boxes"},
            )
        )
        traces.append(
            _scatter(
                webgl, x=(s + e_) / 2, y=y, mode="markers", name="merged (zoom in)", legendgroup="merged",
                showlegend=False, marker={"size": 6, "color": FAMILIES["merged"], "opacity": 0.35},
                hovertext=[_agg_hover(cols, lod, j) for j in range(len(s))],
                hovertemplate="%{hovertext}<extra></extra>",
                customdata=np.column_stack([np.full(len(s), -1), -(np.arange(len(s)) + 1)]),
                meta={"role": "hover"},
            )
        )
    # instant markers: syncs, OOMs (compiles are boxes and also get a star)
    mk_idx = np.nonzero(cols.kind_mask(*_MARKER_KINDS))[0]
    if window is not None and len(mk_idx):
        mk_idx = mk_idx[(cols.end[mk_idx] >= window[0]) & (cols.start[mk_idx] <= window[1])]
    oom_x: list[float] = []
    for kind, (label, symbol, color) in _MARKER_KINDS.items():
        ids = [i for i in mk_idx.tolist() if evs[i].kind == kind]
        if not ids:
            continue
        if len(ids) > max_boxes:  # keep the payload bounded: one marker per pixel column
            arr = np.asarray(ids, dtype=np.int64)
            bins = ((cols.start[arr] - cols.start[arr].min()) / max(lod.pixel_ns, 1e-9)).astype(np.int64)
            _, first = np.unique(bins * (nlanes + 1) + cols.lane[arr], return_index=True)
            ids = arr[np.sort(first)].tolist()
        xs_m = [(evs[i].start_ns - t0) / 1e3 for i in ids]
        if kind == "oom":
            oom_x.extend(xs_m)
        traces.append(
            _scatter(
                webgl, x=xs_m, y=[float(cols.lane[i]) for i in ids], mode="markers", name=label,
                marker={"symbol": symbol, "size": 13, "color": color, "line": {"width": 1, "color": "#333"}},
                hovertext=[_hover_html(event_details(evs[i], profile)) for i in ids],
                hovertemplate="%{hovertext}<extra></extra>",
                customdata=[[evs[i].seq, i] for i in ids], meta={"role": "marker", "kind": kind},
            )
        )
    fig = go.Figure(traces)
    for x in oom_x[:50]:
        fig.add_vline(x=x, line={"color": "#d62728", "dash": "dot", "width": 1})
    height = max(260, 100 + 40 * nlanes + (110 if rangeslider else 0))
    fig.update_layout(
        title=title,
        height=height,
        width=width,
        margin={"l": 140, "r": 20, "t": 80 if title else 60, "b": 40},
        hovermode="closest",
        hoverdistance=30,
        dragmode="zoom",
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0, "font": {"size": 11}},
        xaxis={"title": {"text": "time since first event (µs)"}, "showgrid": True, "zeroline": False,
               "rangeslider": {"visible": rangeslider}},
        yaxis={"tickmode": "array", "tickvals": list(range(nlanes)), "ticktext": cols.lanes,
               "range": [nlanes - 0.5, -0.5], "fixedrange": True, "showgrid": False, "zeroline": False},
        meta={
            "t0_ns": t0,
            "lanes": cols.lanes,
            "num_events": len(evs),
            "num_boxes": lod.num_boxes,
            "merged": int(lod.agg_count.sum()) if len(lod.agg_count) else 0,
            "profile": profile,
            "renderer": "webgl" if webgl else "svg",
            "kinds": sorted(cols.kinds),
        },
        template="plotly_white",
    )
    if window is not None:
        fig.update_xaxes(range=[(window[0] - t0) / 1e3, (window[1] - t0) / 1e3])
    return fig


# ------------------------------------------------------------------------------------ memory
def _device_traces(snapshot: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    if isinstance(snapshot, Mapping):
        return [list(t) for t in snapshot.get("device_traces", [])]
    return [list(snapshot)]  # one device's trace entries


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
    traces = _device_traces(snapshot)
    entries = traces[device] if device < len(traces) else []
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
                text=[f"peak {_fmt_bytes(tl['peak_allocated'])}"], textposition="top center",
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


def _user_frame(frames: Sequence[Mapping[str, Any]]) -> str:
    """First frame (innermost first) outside torch/our package, as 'file:line in func'."""
    for fr in frames:
        fn = str(fr.get("filename", ""))
        if "/torch/" in fn or "/torchneuron_lab/" in fn:
            continue
        return f"{fn}:{fr.get('line', 0)} in {fr.get('name', '')}"
    if frames:
        fr = frames[0]
        return f"{fr.get('filename', '')}:{fr.get('line', 0)} in {fr.get('name', '')}"
    return "unknown (record history with context to see it)"


def _state_at(snapshot: Mapping[str, Any], device: int, index: int | None) -> tuple[dict[int, int], dict[int, dict[str, Any]]]:
    """Segments ``{addr: size}`` and live blocks ``{addr: {size, frames}}`` after action ``index``
    (None: now), undoing later actions of ``device_traces`` from the current state."""
    segs = {int(s["address"]): int(s["total_size"]) for s in snapshot.get("segments", [])
            if int(s.get("device", 0)) == device}
    blocks = {int(b["address"]): {"size": int(b["size"]), "frames": list(b.get("frames", []))}
              for s in snapshot.get("segments", []) if int(s.get("device", 0)) == device
              for b in s.get("blocks", []) if b.get("state") == "active_allocated"}
    traces = _device_traces(snapshot)
    entries = traces[device] if device < len(traces) else []
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
    rows = [{"address": a, "size": b["size"], "source": _user_frame(b["frames"])} for a, b in blocks.items()]
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
                             f"allocated at: {html.escape(_user_frame(b['frames']))}")
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
