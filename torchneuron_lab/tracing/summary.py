"""Pure summaries of recorded events: plain dicts and lists, no drawing, no printing.

Every function takes an iterable of :class:`~torchneuron_lab.tracing.events.KernelEvent` (a
:class:`~torchneuron_lab.tracing.events.Trace` works too) and returns JSON-serialisable data. Times are
the recorder's measured nanoseconds; the only estimate anywhere is ``est_total_ns`` in
:func:`top_kernels`, which sums the events' roofline ESTIMATES and says so in its name.

A *lane* is one (device, engine) pair: one row of the timeline.

Idle time is reported two ways, and they are never mixed: :func:`idle_gaps` and
:func:`lane_utilization` are PER LANE (a lane can idle while another works, so their idle times add up
to more than the trace's span), while :func:`activity` is the UNION OF LANES -- the stretches of the
trace's span in which no lane was busy -- so that ``busy_ns + idle_ns == span_ns`` exactly. A summary
line that sets idle time next to the span uses :func:`activity`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from torchneuron_lab.tracing.events import DIRECTIONS, ENGINES, KernelEvent, RecordedColumns

__all__ = [
    "BOUND_CLASSES",
    "BUSY_KINDS",
    "DEVICE_BOUND_FRACTION",
    "SYNC_BOUND_FRACTION",
    "TOP_KERNEL_KEYS",
    "activity",
    "classify_region",
    "host_waits",
    "idle_gaps",
    "lane_utilization",
    "new_signatures",
    "queue_depth",
    "summarize",
    "sync_events",
    "time_by_engine",
    "top_kernels",
    "transfers",
]

#: Kinds that occupy an engine lane (syncs, markers and OOMs are instants/host waits, not engine work).
BUSY_KINDS: tuple[str, ...] = ("kernel", "dma", "compile")
#: Keys :func:`top_kernels` can sort by.
TOP_KERNEL_KEYS: tuple[str, ...] = ("total_ns", "count", "mean_ns", "max_ns", "bytes", "flops")


def _engine_key(engine: str) -> tuple[int, str]:
    return (ENGINES.index(engine), "") if engine in ENGINES else (len(ENGINES), engine)


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of [start, end) intervals, sorted, overlapping/touching ones merged."""
    merged: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def _select(events: Iterable[KernelEvent], kinds: Iterable[str] | None) -> list[KernelEvent]:
    if kinds is None:
        return list(events)
    wanted = {kinds} if isinstance(kinds, str) else set(kinds)
    return [e for e in events if e.kind in wanted]


def _lanes(events: list[KernelEvent]) -> dict[tuple[int, str], list[KernelEvent]]:
    lanes: dict[tuple[int, str], list[KernelEvent]] = defaultdict(list)
    for e in events:
        lanes[(e.device, e.engine)].append(e)
    return dict(sorted(lanes.items(), key=lambda kv: (kv[0][0], _engine_key(kv[0][1]))))


def _rate(amount: int, ns: int) -> float | None:
    return amount / (ns / 1e9) if ns > 0 else None


def time_by_engine(
    events: Iterable[KernelEvent],
    *,
    kinds: Iterable[str] | None = BUSY_KINDS,
    device: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Measured time per engine class.

    Returns ``{engine: {"count", "total_ns", "busy_ns", "share"}}`` in :data:`ENGINES` order, where
    ``total_ns`` sums durations, ``busy_ns`` is the union of the engine's intervals per device (so
    overlapping events are counted once), and ``share`` is ``total_ns`` over all engines' total.

    Args:
        kinds: event kinds to count (default :data:`BUSY_KINDS`); None for all.
        device: restrict to one device index.
    """
    evs = [e for e in _select(events, kinds) if device is None or e.device == device]
    grand = sum(e.dur_ns for e in evs)
    out: dict[str, dict[str, Any]] = {}
    engines = sorted({e.engine for e in evs}, key=_engine_key)
    lanes = _lanes(evs)
    for engine in engines:
        mine = [e for e in evs if e.engine == engine]
        total = sum(e.dur_ns for e in mine)
        busy = sum(
            sum(b - a for a, b in _merge([(e.start_ns, e.end_ns) for e in lane]))
            for (_, eng), lane in lanes.items()
            if eng == engine
        )
        out[engine] = {
            "count": len(mine),
            "total_ns": total,
            "busy_ns": busy,
            "share": total / grand if grand else 0.0,
        }
    return out


def top_kernels(
    events: Iterable[KernelEvent],
    k: int | None = 10,
    *,
    by: str = "total_ns",
    kinds: Iterable[str] | None = ("kernel",),
) -> list[dict[str, Any]]:
    """The ``k`` kernels (grouped by name) with the largest ``by``, ties broken by name.

    Each row: ``name``, ``engine`` (most frequent), ``count``, ``total_ns``, ``mean_ns``, ``min_ns``,
    ``max_ns``, ``share`` (of all selected kernel time), ``bytes_read``, ``bytes_written``, ``bytes``
    (their sum), ``flops``, ``achieved_bytes_per_s`` and ``achieved_flops_per_s`` (totals over measured
    total time; None when that time is 0), ``new_signatures`` (how many were first-seen signatures) and
    ``est_total_ns`` (sum of the roofline ESTIMATES, None unless every event has one).

    Args:
        k: how many rows (None: all).
        by: one of :data:`TOP_KERNEL_KEYS`.
        kinds: kinds counted as kernels (default only 'kernel'; DMA is in :func:`transfers`).

    Raises:
        ValueError: unknown ``by`` or negative ``k``.
    """
    if by not in TOP_KERNEL_KEYS:
        raise ValueError(f"cannot sort kernels by {by!r}; choose one of {', '.join(TOP_KERNEL_KEYS)}")
    if k is not None and k < 0:
        raise ValueError(f"k must be >= 0 or None, got {k}")
    evs = _select(events, kinds)
    grand = sum(e.dur_ns for e in evs)
    groups: dict[str, list[KernelEvent]] = defaultdict(list)
    for e in evs:
        groups[e.name].append(e)
    rows: list[dict[str, Any]] = []
    for name, group in groups.items():
        durs = [e.dur_ns for e in group]
        total = sum(durs)
        b_read = sum(e.bytes_read for e in group)
        b_written = sum(e.bytes_written for e in group)
        flops = sum(e.flops for e in group)
        engines = Counter(e.engine for e in group)
        engine = min(engines, key=lambda x: (-engines[x], _engine_key(x)))
        ests = [e.est_ns for e in group]
        rows.append(
            {
                "name": name,
                "engine": engine,
                "count": len(group),
                "total_ns": total,
                "mean_ns": total / len(group),
                "min_ns": min(durs),
                "max_ns": max(durs),
                "share": total / grand if grand else 0.0,
                "bytes_read": b_read,
                "bytes_written": b_written,
                "bytes": b_read + b_written,
                "flops": flops,
                "achieved_bytes_per_s": _rate(b_read + b_written, total),
                "achieved_flops_per_s": _rate(flops, total),
                "new_signatures": sum(1 for e in group if e.new_signature),
                "est_total_ns": None if any(x is None for x in ests) else float(sum(x for x in ests if x is not None)),
            }
        )
    rows.sort(key=lambda r: (-r[by], r["name"]))
    return rows if k is None else rows[:k]


def sync_events(events: Iterable[KernelEvent]) -> list[dict[str, Any]]:
    """Every host<->device synchronisation (kind 'sync'), in time order.

    Each row: ``seq``, ``name`` (e.g. 'aten::item'), ``device``, ``stream`` (the stream waited on, -1: the
    whole device), ``start_ns``, ``end_ns``, ``wait_ns``
    (how long the host waited), ``source`` (notebook cell/line if known) and ``location`` (source, or
    innermost stack frame).
    """
    rows = []
    for e in sorted(_select(events, ("sync",)), key=lambda x: (x.start_ns, x.seq)):
        rows.append(
            {
                "seq": e.seq,
                "name": e.name,
                "device": e.device,
                "stream": e.stream,
                "start_ns": e.start_ns,
                "end_ns": e.end_ns,
                "wait_ns": e.dur_ns,
                "source": e.source,
                "location": e.location,
            }
        )
    return rows


def transfers(events: Iterable[KernelEvent]) -> dict[str, dict[str, Any]]:
    """DMA traffic by direction.

    Returns ``{direction: {"count", "bytes", "total_ns", "bytes_per_s"}}`` with 'h2d', 'd2h', 'd2d'
    always present (zeros when absent) and any other direction after them ('' is reported as
    'unknown'). A transfer's bytes are ``max(bytes_read, bytes_written)``: a copy reads and writes the
    same bytes once. ``bytes_per_s`` is achieved bandwidth over measured time (None when 0 ns).
    """
    acc: dict[str, dict[str, Any]] = {d: {"count": 0, "bytes": 0, "total_ns": 0} for d in DIRECTIONS}
    for e in _select(events, ("dma",)):
        key = e.direction or "unknown"
        row = acc.setdefault(key, {"count": 0, "bytes": 0, "total_ns": 0})
        row["count"] += 1
        row["bytes"] += max(e.bytes_read, e.bytes_written)
        row["total_ns"] += e.dur_ns
    extra = sorted(set(acc) - set(DIRECTIONS))
    return {
        d: {**acc[d], "bytes_per_s": _rate(acc[d]["bytes"], acc[d]["total_ns"])} for d in (*DIRECTIONS, *extra)
    }


def new_signatures(events: Iterable[KernelEvent]) -> list[dict[str, Any]]:
    """Events whose op signature was seen for the first time (a NEFF compile on real Trainium).

    Rows in ``seq`` order: ``seq``, ``name``, ``device``, ``engine``, ``shapes``, ``dtypes``,
    ``start_ns``, ``source``, ``location``.
    """
    return [
        {
            "seq": e.seq,
            "name": e.name,
            "device": e.device,
            "engine": e.engine,
            "shapes": e.shapes,
            "dtypes": e.dtypes,
            "start_ns": e.start_ns,
            "source": e.source,
            "location": e.location,
        }
        for e in sorted(events, key=lambda x: x.seq)
        if e.new_signature
    ]


def idle_gaps(
    events: Iterable[KernelEvent],
    *,
    min_gap_ns: int = 0,
    kinds: Iterable[str] | None = BUSY_KINDS,
    unrecorded: tuple[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Idle stretches inside each lane: time between one busy stretch's end and the next one's start.

    Only gaps strictly inside a lane's span count (not before its first or after its last event).
    Overlapping events in a lane are merged first.

    Rows ordered by device, engine, start: ``device``, ``engine``, ``start_ns``, ``end_ns``,
    ``gap_ns``, ``after`` (name of the event that ended last before the gap) and ``before`` (name of
    the first event after it).

    A recording that dropped events (``unrecorded``: :func:`unrecorded_window`, found on a :class:`Trace` by
    itself) knows nothing of that stretch: a gap across it is cut in two, each piece naming
    :data:`NOT_RECORDED` on the window's side, and ``min_gap_ns`` applies to each piece.

    Args:
        min_gap_ns: report only gaps at least this long (gaps of 0 ns are never reported).
        kinds: kinds that make a lane busy (default :data:`BUSY_KINDS`); None for all.
        unrecorded: the stretch nothing was recorded in (default: the Trace's own).
    """
    if min_gap_ns < 0:
        raise ValueError(f"min_gap_ns must be >= 0, got {min_gap_ns}")
    if unrecorded is None:
        unrecorded = unrecorded_window(events)
    rows: list[dict[str, Any]] = []
    for (device, engine), lane in _lanes(_select(events, kinds)).items():
        lane = sorted(lane, key=lambda x: (x.start_ns, x.end_ns, x.seq))
        busy_end: int | None = None
        last_name = ""
        for e in lane:
            if busy_end is not None and e.start_ns > busy_end:
                rows.extend(lane_gap(device, engine, busy_end, e.start_ns, last_name, e.name, unrecorded,
                                     min_gap_ns))
            if busy_end is None or e.end_ns >= busy_end:
                busy_end = e.end_ns
                last_name = e.name
    return rows


#: What :func:`idle_gaps` names on the side of a gap where the recording dropped events.
NOT_RECORDED = "(not recorded)"


def lane_gap(device: Any, engine: str, start: int, end: int, after: str, before: str,
             window: tuple[int, int] | None, min_gap_ns: int = 0) -> list[dict[str, Any]]:
    """:func:`idle_gaps` rows for one idle stretch of a lane: itself, or the pieces of it outside ``window``
    (each naming :data:`NOT_RECORDED` on the window's side); pieces shorter than ``min_gap_ns`` or empty
    are left out."""
    pieces = [(start, end, after, before)]
    if window is not None and start < window[1] and end > window[0]:
        pieces = [(start, min(end, window[0]), after, NOT_RECORDED), (max(start, window[1]), end, NOT_RECORDED, before)]
    return [{"device": device, "engine": engine, "start_ns": a, "end_ns": b, "gap_ns": b - a, "after": left,
             "before": right} for a, b, left, right in pieces if b > a and b - a >= min_gap_ns]


def lane_row(device: Any, engine: str, count: int, busy_ns: int, lo: int, hi: int,
             window: tuple[int, int] | None) -> dict[str, Any]:
    """One :func:`lane_utilization` row; ``busy_ns`` already excludes ``window``."""
    unrec = unrecorded_ns(window, lo, hi)
    recorded = hi - lo - unrec
    return {"device": device, "engine": engine, "count": count, "busy_ns": busy_ns, "span_ns": hi - lo,
            "idle_ns": recorded - busy_ns, "unrecorded_ns": unrec,
            "utilization": busy_ns / recorded if recorded else None}


def unrecorded_window(events: Any) -> tuple[int, int] | None:
    """``(start, end)`` of the stretch a bounded recording dropped events from (``trace.metadata
    ["dropped_window_ns"]`` of a :class:`Trace` that dropped events), else None. Nothing was recorded there,
    so no summary may count that time as idle."""
    if not int(getattr(events, "dropped", 0) or 0):
        return None
    window = (getattr(events, "metadata", None) or {}).get("dropped_window_ns")
    if not window or int(window[1]) <= int(window[0]):
        return None
    return int(window[0]), int(window[1])


def unrecorded_ns(window: tuple[int, int] | None, lo: int, hi: int) -> int:
    """Time of ``window`` inside the span ``[lo, hi]``: neither busy nor idle (intervals are clipped out of
    it first, :func:`clip_out`; a kept event that overlaps it counts only outside it)."""
    if window is None:
        return 0
    return max(0, min(window[1], hi) - max(window[0], lo))


def clip_out(start: Any, end: Any, window: tuple[int, int] | None) -> tuple[Any, Any]:
    """Intervals ``[start, end)`` (int64 arrays) less the part inside ``window``: an interval across it
    becomes two. Unchanged without a window."""
    if window is None:
        return start, end
    import numpy as np

    s, e = np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64)
    left_e, right_s = np.minimum(e, window[0]), np.maximum(s, window[1])
    left, right = left_e > s, e > right_s
    return np.concatenate([s[left], right_s[right]]), np.concatenate([left_e[left], e[right]])


def _clip_pairs(pairs: list[tuple[int, int]], window: tuple[int, int] | None) -> list[tuple[int, int]]:
    if window is None or not pairs:
        return pairs
    s, e = clip_out([a for a, _ in pairs], [b for _, b in pairs], window)
    return list(zip(s.tolist(), e.tolist()))


def cut_window(gaps: list[dict[str, int]], window: tuple[int, int] | None) -> list[dict[str, int]]:
    """Idle stretches (``{"start_ns", "end_ns", "gap_ns"}``) less the part inside ``window``."""
    if window is None:
        return gaps
    w0, w1 = window
    out = []
    for g in gaps:
        if g["end_ns"] <= w0 or g["start_ns"] >= w1:
            out.append(g)
            continue
        for a, b in ((g["start_ns"], min(g["end_ns"], w0)), (max(g["start_ns"], w1), g["end_ns"])):
            if b > a:
                out.append({"start_ns": a, "end_ns": b, "gap_ns": b - a})
    return out


def activity(
    events: Iterable[KernelEvent], *, kinds: Iterable[str] | None = BUSY_KINDS,
    unrecorded: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Busy and idle time of the trace as a whole: the UNION of all lanes.

    ``span_ns`` runs from the first event's start to the last event's end (events of every kind, so a
    trailing host sync is inside the span); ``busy_ns`` is the union of the intervals of the ``kinds``
    events on every lane (time in which at least one lane was busy); ``idle_ns = span_ns - busy_ns``
    (time in which no lane was busy, so ``idle_ns <= span_ns`` and ``busy_ns + idle_ns == span_ns``);
    ``gaps`` lists those idle stretches as ``{"start_ns", "end_ns", "gap_ns"}`` in time order (leading
    and trailing ones inside the span included), so ``sum(g["gap_ns"]) == idle_ns``.

    A recording that dropped events (``unrecorded``: :func:`unrecorded_window`, found on a :class:`Trace`
    by itself) knows nothing of that stretch: its time outside the busy intervals is ``unrecorded_ns``, not
    idle, and no gap covers it; then ``busy_ns + idle_ns + unrecorded_ns == span_ns``.

    Args:
        kinds: kinds that make a lane busy (default :data:`BUSY_KINDS`); None for all.
    """
    if unrecorded is None:
        unrecorded = unrecorded_window(events)
    evs = list(events)
    if not evs:
        return {"span_ns": 0, "busy_ns": 0, "idle_ns": 0, "unrecorded_ns": 0, "gaps": []}
    lo = min(e.start_ns for e in evs)
    hi = max(e.end_ns for e in evs)
    merged = _merge(_clip_pairs([(e.start_ns, e.end_ns) for e in _select(evs, kinds)], unrecorded))
    gaps: list[dict[str, int]] = []
    cursor = lo
    for s, e in merged:
        if s > cursor:
            gaps.append({"start_ns": cursor, "end_ns": s, "gap_ns": s - cursor})
        cursor = max(cursor, e)
    if hi > cursor:
        gaps.append({"start_ns": cursor, "end_ns": hi, "gap_ns": hi - cursor})
    busy = sum(b - a for a, b in merged)
    unrec = unrecorded_ns(unrecorded, lo, hi)
    return {"span_ns": hi - lo, "busy_ns": busy, "idle_ns": hi - lo - busy - unrec, "unrecorded_ns": unrec,
            "gaps": cut_window(gaps, unrecorded)}


def lane_utilization(
    events: Iterable[KernelEvent], *, kinds: Iterable[str] | None = BUSY_KINDS,
    unrecorded: tuple[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Per lane: ``device``, ``engine``, ``count``, ``busy_ns`` (union of intervals), ``span_ns``
    (first start to last end), ``idle_ns`` (span minus busy and unrecorded), ``unrecorded_ns`` and ``utilization``
    (busy / recorded time; None for a zero span), ordered by device then engine.

    A recording that dropped events (``unrecorded``: :func:`unrecorded_window`, found on a :class:`Trace` by
    itself) knows nothing of that stretch: its part of the lane's span is ``unrecorded_ns``, neither busy
    nor idle, so ``busy_ns + idle_ns + unrecorded_ns == span_ns``.
    """
    if unrecorded is None:
        unrecorded = unrecorded_window(events)
    rows = []
    for (device, engine), lane in _lanes(_select(events, kinds)).items():
        busy = sum(b - a for a, b in _merge(_clip_pairs([(e.start_ns, e.end_ns) for e in lane], unrecorded)))
        lo, hi = min(e.start_ns for e in lane), max(e.end_ns for e in lane)
        rows.append(lane_row(device, engine, len(lane), busy, lo, hi, unrecorded))
    return rows


# ------------------------------------------------------------------------------ host / device / sync
#: Classes of :func:`classify_region`, in the order they are decided.
BOUND_CLASSES: tuple[str, ...] = ("no device work", "device-bound", "sync-bound", "host-bound")
#: Device-bound: the device queue held work (a kernel queued or running) at least this share of the span.
DEVICE_BOUND_FRACTION = 0.9
#: Sync-bound (when not device-bound): the host waited at syncs at least this share of the span.
SYNC_BOUND_FRACTION = 0.2
_DEVICE_KINDS = ("kernel", "dma")


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in _merge(intervals))


def _intersect_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Length of the intersection of two MERGED (sorted, disjoint) interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def host_waits(events: Iterable[KernelEvent], *, top: int | None = 5) -> dict[str, Any]:
    """Where the host waited for the device: the sync events (kind 'sync') grouped by the line that waited.

    Returns ``{"count", "wait_ns", "by_location": [{"location", "count", "wait_ns", "names"}]}``: ``wait_ns``
    sums the syncs' durations (the time the host was blocked); ``by_location`` is sorted by wait (largest
    first, then location), ``names`` lists the sync causes seen on that line ('aten::_local_scalar_dense'
    for ``item()``, 'copy d2h', 'torch.neuron.synchronize', ...), and holds the ``top`` lines (None: all).
    A sync without a known line is grouped under 'unknown'.
    """
    cols = getattr(events, "columns", None)
    if isinstance(cols, RecordedColumns):  # a recorded trace: build the sync rows' events only
        syncs = cols.events_at(cols.rows_of_kind("sync"))
    else:
        syncs = _select(events, ("sync",))
    groups: dict[str, list[KernelEvent]] = defaultdict(list)
    for e in syncs:
        groups[e.location or "unknown"].append(e)
    rows: list[dict[str, Any]] = [
        {
            "location": loc,
            "count": len(g),
            "wait_ns": sum(e.dur_ns for e in g),
            "names": sorted({e.name for e in g}),
        }
        for loc, g in groups.items()
    ]
    rows.sort(key=lambda r: (-r["wait_ns"], r["location"]))
    return {
        "count": len(syncs),
        "wait_ns": sum(e.dur_ns for e in syncs),
        "by_location": rows if top is None else rows[:top],
    }


def _enqueue_ns(e: KernelEvent) -> int:
    """When the kernel joined its queue: the end of its host launch, or (launch unknown) its start."""
    return e.host_end_ns if e.host_end_ns > 0 else e.start_ns


def queue_depth(events: Iterable[KernelEvent], device: int | None = None) -> dict[int, dict[str, list[int]]]:
    """Kernels (and DMA) queued or running on each device over time, as a step function.

    The depth at ``t`` is the number of kernels whose launch ended (``host_end_ns``; the start when the
    launch is unknown) at or before ``t`` minus those that ended at or before ``t``. Returns
    ``{device: {"t_ns": [...], "depth": [...]}}``: the depth from ``t_ns[i]`` until ``t_ns[i + 1]``;
    the first point is the first launch, the last the last end (depth 0).

    Args:
        device: one device index (default: every device with kernels).
    """
    deltas: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for e in _select(events, _DEVICE_KINDS):
        if e.device < 0 or (device is not None and e.device != device):
            continue
        d = deltas[e.device]
        d[min(_enqueue_ns(e), e.start_ns)] += 1
        d[e.end_ns] -= 1
    out: dict[int, dict[str, list[int]]] = {}
    for dev in sorted(deltas):
        ts: list[int] = []
        depth: list[int] = []
        level = 0
        for t in sorted(deltas[dev]):
            level += deltas[dev][t]
            if depth and depth[-1] == level:
                continue
            ts.append(t)
            depth.append(level)
        out[dev] = {"t_ns": ts, "depth": depth}
    return out


def classify_region(events: Iterable[KernelEvent], *, top: int = 3,
                    unrecorded: tuple[int, int] | None = None) -> dict[str, Any]:
    """Is the profiled region host-bound, device-bound or sync-bound? A pure function of the events.

    The region's span runs from the first host launch or event start to the last event end. Decided in
    this order (thresholds :data:`DEVICE_BOUND_FRACTION`, :data:`SYNC_BOUND_FRACTION`):

    * ``"no device work"``: no kernel or DMA ran.
    * ``"device-bound"``: the device queue held work (a kernel launched and not yet finished, see
      :func:`queue_depth`, on any device) for at least 90% of the span: the device was the bottleneck.
    * ``"sync-bound"``: otherwise, when the host waited at syncs (``item()``, ``.cpu()``, printing,
      ``synchronize``...) for at least 20% of the span: each wait drains the queue, so the host's own
      work after it cannot overlap the device's.
    * ``"host-bound"``: otherwise: the device was idle while the host ran (launching kernels: launch
      overhead; or Python between launches).

    Returns ``{"class", "headline", "span_ns", "device_busy_ns", "device_idle_ns", "device_idle_fraction",
    "launch_ns" (union of host launch spans), "idle_while_launching_ns" (device idle during them),
    "idle_while_launching_fraction", "queue_busy_ns", "queue_busy_fraction", "sync_count",
    "sync_wait_ns" (sum), "sync_wait_fraction" (union over the span), "top_sync_lines"
    (:func:`host_waits`' rows), "launches_known", "unrecorded_ns"}``. Fractions are of the recorded span,
    ``span_ns - unrecorded_ns`` (0.0 for an empty span): a recording that dropped events knows nothing of
    that stretch (``unrecorded``, see :func:`activity`), so it is in no fraction and no verdict.
    """
    if unrecorded is None:
        unrecorded = unrecorded_window(events)
    evs = list(events)
    work = [e for e in _select(evs, _DEVICE_KINDS) if e.device >= 0]
    syncs = _select(evs, ("sync",))
    launches = [(e.host_start_ns, e.host_end_ns) for e in work if e.host_end_ns > 0]
    lo = min([e.start_ns for e in evs] + [a for a, _ in launches], default=0)
    hi = max((e.end_ns for e in evs), default=0)
    w = unrecorded  # every interval is clipped out of a dropped stretch: nothing is known there
    busy = _merge(_clip_pairs([(e.start_ns, e.end_ns) for e in work], w))
    launch_m = _merge(_clip_pairs(launches, w))
    launch_ns = sum(b - a for a, b in launch_m)
    return _classification(
        span=hi - lo, has_work=bool(work), busy_ns=sum(b - a for a, b in busy),
        unrecorded_ns=unrecorded_ns(w, lo, hi),
        queue_ns=_union_ns(_clip_pairs([(min(_enqueue_ns(e), e.start_ns), e.end_ns) for e in work], w)),
        launch_ns=launch_ns, idle_launching=launch_ns - _intersect_ns(launch_m, busy),
        wait_union=_union_ns(_clip_pairs([(e.start_ns, e.end_ns) for e in syncs], w)),
        waits=host_waits(syncs, top=top), launches_known=bool(launches),
    )


def _classification(*, span: int, has_work: bool, busy_ns: int, queue_ns: int, launch_ns: int,
                    idle_launching: int, wait_union: int, waits: dict[str, Any],
                    launches_known: bool, unrecorded_ns: int = 0) -> dict[str, Any]:
    """The decision of :func:`classify_region` from the measured times (one rule for every input path)."""
    wall = span
    span = max(wall - unrecorded_ns, 0)  # the recorded part: what the fractions and the verdict are of

    def frac(x: int) -> float:
        return x / span if span > 0 else 0.0

    idle_ns = span - busy_ns if has_work else span
    out: dict[str, Any] = {
        "span_ns": wall,
        "unrecorded_ns": unrecorded_ns,
        "device_busy_ns": busy_ns,
        "device_idle_ns": idle_ns,
        "device_idle_fraction": frac(idle_ns),
        "launch_ns": launch_ns,
        "idle_while_launching_ns": idle_launching,
        "idle_while_launching_fraction": frac(idle_launching),
        "queue_busy_ns": queue_ns,
        "queue_busy_fraction": frac(queue_ns),
        "sync_count": waits["count"],
        "sync_wait_ns": waits["wait_ns"],
        "sync_wait_fraction": frac(wait_union),
        "top_sync_lines": waits["by_location"],
        "launches_known": launches_known,
    }
    of_span = f"{_fmt_ns(span)} span"
    if unrecorded_ns:
        of_span = (f"{_fmt_ns(span)} recorded ({_fmt_ns(unrecorded_ns)} of the {_fmt_ns(wall)} span is not: "
                   "the recorder dropped events there)")
    top_line = ""
    if waits["by_location"]:
        first = waits["by_location"][0]
        top_line = f"; most at {first['location']} ({_fmt_ns(first['wait_ns'])} in {first['count']})"
    if not has_work:
        cls, head = "no device work", "no device work: no kernel or transfer ran"
    elif span > 0 and queue_ns >= DEVICE_BOUND_FRACTION * span:
        cls = "device-bound"
        head = (f"device-bound: the device queue held work {out['queue_busy_fraction']:.0%} of the "
                f"{of_span} (device busy {frac(busy_ns):.0%})")
    elif span > 0 and wait_union >= SYNC_BOUND_FRACTION * span:
        cls = "sync-bound"
        head = (f"sync-bound: the host waited {_fmt_ns(waits['wait_ns'])} at {waits['count']} "
                f"sync{'s' if waits['count'] != 1 else ''} ({out['sync_wait_fraction']:.0%} of the "
                f"{of_span}){top_line}")
    else:
        cls = "host-bound"
        if launches_known:
            # overall idle first; then how much of the span was launch overhead vs the host's other code
            head = (f"host-bound: the device was idle {out['device_idle_fraction']:.0%} of the "
                    f"{of_span} ({out['idle_while_launching_fraction']:.0%} of the span while the "
                    f"host was launching kernels, the rest while it ran other code)")
        else:
            head = (f"host-bound: the device was idle {out['device_idle_fraction']:.0%} of the "
                    f"{of_span} (launch times not recorded: synchronous trace)")
    out["class"] = cls
    out["headline"] = head
    return out


def _fmt_ns(ns: float) -> str:
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.2f} µs"
    if ns < 1e9:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.3f} s"


# ------------------------------------------------------------------------------ summarize
def summarize(events: Iterable[KernelEvent], *, k: int | None = 10) -> dict[str, Any]:
    """All summaries at once: ``num_events``, ``span_ns`` (first event start, or first host launch of an
    asynchronous trace, to the last event end), ``activity`` (union of lanes),
    ``time_by_engine``, ``top_kernels``, ``sync_events``, ``transfers``, ``new_signatures``,
    ``lane_utilization`` and ``idle_gaps`` (per lane), ``host_waits`` and ``bound``
    (:func:`classify_region`).

    A :class:`~torchneuron_lab.tracing.Trace` read from the recorder (``trace.columns`` set) is
    summarised from its numpy columns without building its event objects; the result is the same.
    """
    window = unrecorded_window(events)
    cols = getattr(events, "columns", None)
    if isinstance(cols, RecordedColumns):
        from torchneuron_lab.tracing._columnar import summarize_columns

        return summarize_columns(cols, k=k, unrecorded=window)
    evs = list(events)
    bound = classify_region(evs, unrecorded=window)
    return {
        "num_events": len(evs),
        "span_ns": bound["span_ns"],
        "activity": activity(evs, unrecorded=window),
        "time_by_engine": time_by_engine(evs),
        "top_kernels": top_kernels(evs, k),
        "sync_events": sync_events(evs),
        "transfers": transfers(evs),
        "new_signatures": new_signatures(evs),
        "lane_utilization": lane_utilization(evs, unrecorded=window),
        "idle_gaps": idle_gaps(evs, unrecorded=window),
        "host_waits": host_waits(evs),
        "bound": bound,
    }
