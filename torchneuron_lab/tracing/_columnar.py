"""The summaries of :mod:`.summary` computed on the recorder's numpy columns (:class:`RecordedColumns`).

:func:`summarize_columns` returns exactly what :func:`torchneuron_lab.tracing.summarize` returns for the
same events (a test checks it field by field), without building one :class:`KernelEvent` per row: the
per-kernel work (unions of intervals, per-lane gaps, per-name totals) is done on whole columns, and only
the few rows a summary lists one by one (syncs, new signatures) become events, through the same
functions the event path uses. numpy is imported here, and this module is imported only when called.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np

from torchneuron_lab.tracing import summary as S
from torchneuron_lab.tracing.events import DIRECTIONS, KernelEvent, RecordedColumns

__all__ = ["summarize_columns"]

_EMPTY = np.zeros(0, dtype=np.int64)


def _subset(cols: RecordedColumns, idx: np.ndarray) -> list[KernelEvent]:
    """Events of rows ``idx`` only."""
    return cols.events_at(idx)


def _merged(s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of ``[s, e)`` intervals as sorted disjoint (starts, ends); touching intervals merge."""
    if len(s) == 0:
        return _EMPTY, _EMPTY
    o = np.argsort(s)  # the order among equal starts does not change the union
    s, e = s[o], e[o]
    run = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > run[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    return s[first], run[last]


def _union_ns(s: np.ndarray, e: np.ndarray) -> int:
    ms, me = _merged(s, e)
    return int((me - ms).sum())


def _mask_of(cols: RecordedColumns, kinds: tuple[str, ...]) -> np.ndarray:
    codes = [i for i, k in enumerate(cols.kinds) if k in kinds]
    return np.isin(cols.arrays["kind"], codes)


def _lane_slices(cols: RecordedColumns, idx: np.ndarray, *extra_keys: np.ndarray) -> list[tuple[int, str, np.ndarray]]:
    """Rows ``idx`` split per lane (device, engine), lanes in display order; inside a lane the rows are
    sorted by ``extra_keys`` (most significant first), stably."""
    if len(idx) == 0:
        return []
    a = cols.arrays
    dev = a["device"][idx].astype(np.int64)
    eng = a["engine"][idx].astype(np.int64)
    lane = (dev + 256) * 1024 + eng
    keys = [k[idx] for k in reversed(extra_keys)] + [lane]
    o = np.lexsort(keys) if keys else np.argsort(lane, kind="stable")
    idx, lane = idx[o], lane[o]
    bounds = np.flatnonzero(np.r_[True, lane[1:] != lane[:-1], True])
    engines = list(cols.engines)
    out = []
    for b0, b1 in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        code = int(lane[b0])
        out.append((code // 1024 - 256, engines[code % 1024], idx[b0:b1]))
    out.sort(key=lambda t: (t[0], S._engine_key(t[1])))
    return out


def _activity(start: np.ndarray, end: np.ndarray, busy: np.ndarray,
              unrecorded: tuple[int, int] | None = None) -> dict[str, Any]:
    if len(start) == 0:
        return {"span_ns": 0, "busy_ns": 0, "idle_ns": 0, "unrecorded_ns": 0, "gaps": []}
    lo, hi = int(start.min()), int(end.max())
    ms, me = _merged(*S.clip_out(start[busy], end[busy], unrecorded))
    gaps: list[dict[str, int]] = []
    bounds = [(lo, *ms[:1].tolist())] if len(ms) and int(ms[0]) > lo else []
    gaps = [{"start_ns": a, "end_ns": b, "gap_ns": b - a} for a, b in bounds]
    gaps += [{"start_ns": a, "end_ns": b, "gap_ns": b - a} for a, b in zip(me[:-1].tolist(), ms[1:].tolist())]
    cursor = int(me[-1]) if len(me) else lo
    if hi > cursor:
        gaps.append({"start_ns": cursor, "end_ns": hi, "gap_ns": hi - cursor})
    busy_ns = int((me - ms).sum())
    unrec = S.unrecorded_ns(unrecorded, lo, hi)
    return {"span_ns": hi - lo, "busy_ns": busy_ns, "idle_ns": hi - lo - busy_ns - unrec, "unrecorded_ns": unrec,
            "gaps": S.cut_window(gaps, unrecorded)}


def _time_by_engine(cols: RecordedColumns, busy_idx: np.ndarray) -> dict[str, dict[str, Any]]:
    a = cols.arrays
    start, end = a["start_ns"], a["end_ns"]
    grand = int((end[busy_idx] - start[busy_idx]).sum())
    acc: dict[str, dict[str, int]] = {}
    for _dev, engine, rows in _lane_slices(cols, busy_idx):
        row = acc.setdefault(engine, {"count": 0, "total_ns": 0, "busy_ns": 0})
        row["count"] += len(rows)
        row["total_ns"] += int((end[rows] - start[rows]).sum())
        row["busy_ns"] += _union_ns(start[rows], end[rows])
    return {
        eng: {**acc[eng], "share": acc[eng]["total_ns"] / grand if grand else 0.0}
        for eng in sorted(acc, key=S._engine_key)
    }


def _top_kernels(cols: RecordedColumns, k: int | None) -> list[dict[str, Any]]:
    a = cols.arrays
    idx = np.flatnonzero(_mask_of(cols, ("kernel",)))
    if len(idx) == 0:
        return []
    start, end = a["start_ns"][idx], a["end_ns"][idx]
    dur = end - start
    grand = int(dur.sum())
    uniq, inv = np.unique(a["name"][idx], return_inverse=True)
    names = cols.strings_of(uniq)
    by_name: dict[str, int] = {}
    group_of_uniq = np.asarray([by_name.setdefault(nm, len(by_name)) for nm in names], dtype=np.int64)
    group = group_of_uniq[inv.reshape(-1)]
    o = np.argsort(group, kind="stable")
    g = group[o]
    first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    counts = np.diff(np.append(first, len(g)))
    dur_o = dur[o]
    total = np.add.reduceat(dur_o, first)
    mn = np.minimum.reduceat(dur_o, first)
    mx = np.maximum.reduceat(dur_o, first)
    b_read = np.add.reduceat(a["bytes_read"][idx][o], first)
    b_written = np.add.reduceat(a["bytes_written"][idx][o], first)
    flops = np.add.reduceat(a["flops"][idx][o], first)
    new_sig = np.add.reduceat(a["new_signature"][idx][o].astype(np.int64), first)
    est = a.get("est_ns")
    est_o = est[idx][o] if est is not None else None
    eng = a["engine"][idx][o].astype(np.int64)
    pair, pair_n = np.unique(g * 1024 + eng, return_counts=True)
    engines = list(cols.engines)
    eng_counts: dict[int, dict[str, int]] = {}
    for p, c in zip(pair.tolist(), pair_n.tolist()):
        eng_counts.setdefault(p // 1024, {})[engines[p % 1024]] = c
    group_names = list(by_name)
    rows: list[dict[str, Any]] = []
    for j, gi in enumerate(g[first].tolist()):
        n = int(counts[j])
        tot = int(total[j])
        ec = eng_counts[gi]
        engine = min(ec, key=lambda x: (-ec[x], S._engine_key(x)))
        br, bw, fl = int(b_read[j]), int(b_written[j]), int(flops[j])
        if est_o is None:
            est_total = None
        else:
            vals = est_o[first[j]:first[j] + n]
            est_total = None if np.isnan(vals).any() else float(sum(vals.tolist()))
        rows.append({
            "name": group_names[gi],
            "engine": engine,
            "count": n,
            "total_ns": tot,
            "mean_ns": tot / n,
            "min_ns": int(mn[j]),
            "max_ns": int(mx[j]),
            "share": tot / grand if grand else 0.0,
            "bytes_read": br,
            "bytes_written": bw,
            "bytes": br + bw,
            "flops": fl,
            "achieved_bytes_per_s": S._rate(br + bw, tot),
            "achieved_flops_per_s": S._rate(fl, tot),
            "new_signatures": int(new_sig[j]),
            "est_total_ns": est_total,
        })
    rows.sort(key=lambda r: (-r["total_ns"], r["name"]))
    return rows if k is None else rows[:k]


def _transfers(cols: RecordedColumns) -> dict[str, dict[str, Any]]:
    a = cols.arrays
    idx = np.flatnonzero(_mask_of(cols, ("dma",)))
    acc: dict[str, dict[str, Any]] = {d: {"count": 0, "bytes": 0, "total_ns": 0} for d in DIRECTIONS}
    if len(idx):
        direction = a["direction"][idx]
        nbytes = np.maximum(a["bytes_read"][idx], a["bytes_written"][idx])
        dur = a["end_ns"][idx] - a["start_ns"][idx]
        for code in np.unique(direction).tolist():
            sel = direction == code
            key = list(cols.directions)[code] or "unknown"
            row = acc.setdefault(key, {"count": 0, "bytes": 0, "total_ns": 0})
            row["count"] += int(sel.sum())
            row["bytes"] += int(nbytes[sel].sum())
            row["total_ns"] += int(dur[sel].sum())
    extra = sorted(set(acc) - set(DIRECTIONS))
    return {d: {**acc[d], "bytes_per_s": S._rate(acc[d]["bytes"], acc[d]["total_ns"])} for d in (*DIRECTIONS, *extra)}


def _lanes(cols: RecordedColumns, busy_idx: np.ndarray,
           unrecorded: tuple[int, int] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(lane_utilization rows, idle_gaps rows)."""
    a = cols.arrays
    start, end, seq = a["start_ns"], a["end_ns"], a["seq"]
    util: list[dict[str, Any]] = []
    gaps: list[dict[str, Any]] = []
    for dev, engine, rows in _lane_slices(cols, busy_idx, start, end, seq):
        s, e = start[rows], end[rows]
        busy = _union_ns(*S.clip_out(s, e, unrecorded))
        util.append(S.lane_row(dev, engine, len(rows), busy, int(s.min()), int(e.max()), unrecorded))
        run = np.maximum.accumulate(e)
        at = np.flatnonzero(s[1:] > run[:-1]) + 1
        if not len(at):
            continue
        # the event that set the running end last (ties: the later one), as idle_gaps names it
        setter = np.maximum.accumulate(np.where(e == run, np.arange(len(e)), -1))
        after = cols.strings_of(a["name"][rows[setter[at - 1]]])
        before = cols.strings_of(a["name"][rows[at]])
        g0, g1 = run[at - 1], s[at]
        if unrecorded is None:
            gaps.extend([{"device": dev, "engine": engine, "start_ns": x0, "end_ns": x1, "gap_ns": d,
                          "after": an, "before": bn}
                         for x0, x1, d, an, bn in zip(g0.tolist(), g1.tolist(), (g1 - g0).tolist(), after, before)])
        else:
            for x0, x1, an, bn in zip(g0.tolist(), g1.tolist(), after, before):
                gaps.extend(S.lane_gap(dev, engine, x0, x1, an, bn, unrecorded))
    return util, gaps


def _classify(cols: RecordedColumns, sync_events: list[KernelEvent],
              unrecorded: tuple[int, int] | None = None) -> dict[str, Any]:
    a = cols.arrays
    start, end = a["start_ns"], a["end_ns"]
    work = _mask_of(cols, S._DEVICE_KINDS) & (a["device"] >= 0)
    h_start, h_end = cols.column("host_start_ns")[work], cols.column("host_end_ns")[work]
    known = h_end > 0
    lo = min(int(start.min()) if cols.n else 0, int(h_start[known].min()) if known.any() else 2**62)
    hi = int(end.max()) if cols.n else 0
    return bound_from_arrays(start[work], end[work], h_start, h_end, known, sync_events, unrecorded,
                             lo, hi, cols.n)


def bound_from_arrays(ws: np.ndarray, we: np.ndarray, h_start: np.ndarray, h_end: np.ndarray, known: np.ndarray,
                      sync_events: list[Any], unrecorded: tuple[int, int] | None, lo: int, hi: int,
                      n: int) -> dict[str, Any]:
    """:func:`summary.classify_region`'s verdict from the device work's columns (start/end, host launch
    start/end, ``known``: launch times recorded) and the sync events, over the span ``lo``..``hi`` of ``n``
    events. Shared by the recorder's columns and the timeline's."""
    w = unrecorded  # every interval is clipped out of a dropped stretch: nothing is known there
    bs, be = _merged(*S.clip_out(ws, we, w))
    busy_ns = int((be - bs).sum())
    enq = np.minimum(np.where(known, h_end, ws), ws)
    ls, le = S.clip_out(h_start[known].astype(np.int64), h_end[known].astype(np.int64), w)
    launch_ns = _union_ns(ls, le)
    both = _union_ns(np.concatenate([ls, bs]), np.concatenate([le, be]))
    wait_union = _union_ns(*S.clip_out(np.asarray([x.start_ns for x in sync_events], dtype=np.int64),
                                       np.asarray([x.end_ns for x in sync_events], dtype=np.int64), w))
    return S._classification(
        span=hi - lo if n else 0, has_work=bool(len(ws)), busy_ns=busy_ns,
        unrecorded_ns=S.unrecorded_ns(w, lo, hi) if n else 0,
        queue_ns=_union_ns(*S.clip_out(enq, we, w)), launch_ns=launch_ns,
        idle_launching=launch_ns - (launch_ns + busy_ns - both),
        # launch times were recorded, whether or not they fall in a dropped stretch
        wait_union=wait_union, waits=S.host_waits(sync_events, top=3), launches_known=bool(known.any()),
    )


def summarize_columns(cols: RecordedColumns, *, k: int | None = 10,
                      unrecorded: tuple[int, int] | None = None) -> dict[str, Any]:
    """:func:`torchneuron_lab.tracing.summarize` of the events of ``cols``, computed on the columns."""
    gc_was = gc.isenabled()
    gc.disable()  # one gap row per kernel, none cyclic: collecting while building them is wasted work
    try:
        return _summarize_columns(cols, k, unrecorded)
    finally:
        if gc_was:
            gc.enable()


def _summarize_columns(cols: RecordedColumns, k: int | None, unrecorded: tuple[int, int] | None) -> dict[str, Any]:
    a = cols.arrays
    start, end = a["start_ns"], a["end_ns"]
    bad = np.flatnonzero(end < start)
    if bad.size:
        cols.events()  # raises the same ValueError the event path raises
    busy = _mask_of(cols, S.BUSY_KINDS)
    busy_idx = np.flatnonzero(busy)
    syncs = _subset(cols, np.flatnonzero(_mask_of(cols, ("sync",))))
    new_sig = _subset(cols, np.flatnonzero(a["new_signature"] != 0))
    util, gaps = _lanes(cols, busy_idx, unrecorded)
    bound = _classify(cols, syncs, unrecorded)
    return {
        "num_events": cols.n,
        "span_ns": bound["span_ns"],
        "activity": _activity(start, end, busy, unrecorded),
        "time_by_engine": _time_by_engine(cols, busy_idx),
        "top_kernels": _top_kernels(cols, k),
        "sync_events": S.sync_events(syncs),
        "transfers": _transfers(cols),
        "new_signatures": S.new_signatures(new_sig),
        "lane_utilization": util,
        "idle_gaps": gaps,
        "host_waits": S.host_waits(syncs),
        "bound": bound,
    }
