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

from torchneuron_lab.tracing.events import DIRECTIONS, ENGINES, KernelEvent

__all__ = [
    "BUSY_KINDS",
    "TOP_KERNEL_KEYS",
    "activity",
    "idle_gaps",
    "lane_utilization",
    "new_signatures",
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

    Each row: ``seq``, ``name`` (e.g. 'aten::item'), ``device``, ``start_ns``, ``end_ns``, ``wait_ns``
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
) -> list[dict[str, Any]]:
    """Idle stretches inside each lane: time between one busy stretch's end and the next one's start.

    Only gaps strictly inside a lane's span count (not before its first or after its last event).
    Overlapping events in a lane are merged first.

    Rows ordered by device, engine, start: ``device``, ``engine``, ``start_ns``, ``end_ns``,
    ``gap_ns``, ``after`` (name of the event that ended last before the gap) and ``before`` (name of
    the first event after it).

    Args:
        min_gap_ns: report only gaps at least this long (gaps of 0 ns are never reported).
        kinds: kinds that make a lane busy (default :data:`BUSY_KINDS`); None for all.
    """
    if min_gap_ns < 0:
        raise ValueError(f"min_gap_ns must be >= 0, got {min_gap_ns}")
    rows: list[dict[str, Any]] = []
    for (device, engine), lane in _lanes(_select(events, kinds)).items():
        lane = sorted(lane, key=lambda x: (x.start_ns, x.end_ns, x.seq))
        busy_end: int | None = None
        last_name = ""
        for e in lane:
            if busy_end is not None and e.start_ns > busy_end:
                gap = e.start_ns - busy_end
                if gap >= min_gap_ns:
                    rows.append(
                        {
                            "device": device,
                            "engine": engine,
                            "start_ns": busy_end,
                            "end_ns": e.start_ns,
                            "gap_ns": gap,
                            "after": last_name,
                            "before": e.name,
                        }
                    )
            if busy_end is None or e.end_ns >= busy_end:
                busy_end = e.end_ns
                last_name = e.name
    return rows


def activity(
    events: Iterable[KernelEvent], *, kinds: Iterable[str] | None = BUSY_KINDS
) -> dict[str, Any]:
    """Busy and idle time of the trace as a whole: the UNION of all lanes.

    ``span_ns`` runs from the first event's start to the last event's end (events of every kind, so a
    trailing host sync is inside the span); ``busy_ns`` is the union of the intervals of the ``kinds``
    events on every lane (time in which at least one lane was busy); ``idle_ns = span_ns - busy_ns``
    (time in which no lane was busy, so ``idle_ns <= span_ns`` and ``busy_ns + idle_ns == span_ns``);
    ``gaps`` lists those idle stretches as ``{"start_ns", "end_ns", "gap_ns"}`` in time order (leading
    and trailing ones inside the span included), so ``sum(g["gap_ns"]) == idle_ns``.

    Args:
        kinds: kinds that make a lane busy (default :data:`BUSY_KINDS`); None for all.
    """
    evs = list(events)
    if not evs:
        return {"span_ns": 0, "busy_ns": 0, "idle_ns": 0, "gaps": []}
    lo = min(e.start_ns for e in evs)
    hi = max(e.end_ns for e in evs)
    merged = _merge([(e.start_ns, e.end_ns) for e in _select(evs, kinds)])
    gaps: list[dict[str, int]] = []
    cursor = lo
    for s, e in merged:
        if s > cursor:
            gaps.append({"start_ns": cursor, "end_ns": s, "gap_ns": s - cursor})
        cursor = max(cursor, e)
    if hi > cursor:
        gaps.append({"start_ns": cursor, "end_ns": hi, "gap_ns": hi - cursor})
    busy = sum(b - a for a, b in merged)
    return {"span_ns": hi - lo, "busy_ns": busy, "idle_ns": hi - lo - busy, "gaps": gaps}


def lane_utilization(
    events: Iterable[KernelEvent], *, kinds: Iterable[str] | None = BUSY_KINDS
) -> list[dict[str, Any]]:
    """Per lane: ``device``, ``engine``, ``count``, ``busy_ns`` (union of intervals), ``span_ns``
    (first start to last end), ``idle_ns`` (span minus busy) and ``utilization`` (busy / span; None for
    a zero span), ordered by device then engine."""
    rows = []
    for (device, engine), lane in _lanes(_select(events, kinds)).items():
        busy = sum(b - a for a, b in _merge([(e.start_ns, e.end_ns) for e in lane]))
        span = max(e.end_ns for e in lane) - min(e.start_ns for e in lane)
        rows.append(
            {
                "device": device,
                "engine": engine,
                "count": len(lane),
                "busy_ns": busy,
                "span_ns": span,
                "idle_ns": span - busy,
                "utilization": busy / span if span else None,
            }
        )
    return rows


def summarize(events: Iterable[KernelEvent], *, k: int | None = 10) -> dict[str, Any]:
    """All summaries at once: ``num_events``, ``span_ns``, ``activity`` (union of lanes),
    ``time_by_engine``, ``top_kernels``, ``sync_events``, ``transfers``, ``new_signatures``,
    ``lane_utilization`` and ``idle_gaps`` (per lane)."""
    evs = list(events)
    span = (max(e.end_ns for e in evs) - min(e.start_ns for e in evs)) if evs else 0
    return {
        "num_events": len(evs),
        "span_ns": span,
        "activity": activity(evs),
        "time_by_engine": time_by_engine(evs),
        "top_kernels": top_kernels(evs, k),
        "sync_events": sync_events(evs),
        "transfers": transfers(evs),
        "new_signatures": new_signatures(evs),
        "lane_utilization": lane_utilization(evs),
        "idle_gaps": idle_gaps(evs),
    }
