"""Chrome Trace Event Format export (chrome://tracing, Perfetto UI) and a format checker.

Layout of the exported trace:

* one process per device: ``pid`` = device index, named ``neuron:<index>`` (events with a negative
  device index go to the ``host`` process, ``pid`` :data:`HOST_PID`);
* one thread per engine class: ``tid`` from :data:`ENGINE_TIDS` (tensor=1 ... host=6), named after the
  engine, in that order;
* kernels, DMA transfers and compile steps are complete events (``ph: 'X'``) with ``ts``/``dur`` in
  microseconds; syncs and OOMs (and zero-length markers) are instant events (``ph: 'i'``);
* ``args`` carry shapes, dtypes, bytes, FLOPs, new-signature flag, source line and, when present, the
  roofline ESTIMATE (``estimate_us``, labelled as an estimate);
* ``otherData`` carries the trace metadata (profile, dropped count, clock origin).

Asynchronous traces (events carry their host launch span, ``host_end_ns > 0``, issue 12) add:

* device tracks per stream: stream 0 keeps the engine's ``tid``; stream ``s > 0`` uses
  ``tid = s * STREAM_TID_STRIDE + engine tid``, named ``'<engine> · stream <s>'``;
* a host process (``pid`` :data:`HOST_PID`, named ``host``) with one track per host thread
  (``tid`` = the recorder's thread id, named ``host thread <id>``): each kernel's launch is a complete
  event there (``cat`` 'launch', name = the op), and each sync is a complete event spanning the time
  the host waited (``cat`` 'sync'; an instant when it did not wait);
* a flow from each launch to its kernel: ``ph 's'`` inside the launch slice and ``ph 'f'`` inside the
  kernel slice, both ``bp: 'e'`` (bound to the enclosing slice), ``name``/``cat`` 'launch' and ``id``
  the launch's correlation id (or :data:`FLOW_ID_BASE` + seq when the recorder gave none), so Perfetto
  and chrome://tracing draw an arrow from the host call to the kernel it queued.

:func:`validate_chrome_trace` checks the parts of the format the viewers rely on.
"""

from __future__ import annotations

import gc
import gzip
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from torchneuron_lab.tracing.events import ENGINES, KernelEvent, Trace, device_name

__all__ = [
    "ENGINE_TIDS",
    "FLOW_ID_BASE",
    "HOST_PID",
    "PHASES",
    "STREAM_TID_STRIDE",
    "chrome_trace_problems",
    "to_chrome_trace",
    "validate_chrome_trace",
    "write_atomically",
    "write_chrome_trace",
]

#: Thread id of each engine lane inside a device process.
ENGINE_TIDS: dict[str, int] = {engine: i + 1 for i, engine in enumerate(ENGINES)}
#: Process id used for events whose device index is negative (host-only events).
HOST_PID = 1_000_000
#: Track ids of stream ``s`` on a device: ``s * STREAM_TID_STRIDE + ENGINE_TIDS[engine]``.
STREAM_TID_STRIDE = 100
#: Flow ids of launches without a correlation id: ``FLOW_ID_BASE + seq``.
FLOW_ID_BASE = 1 << 40
#: Every phase letter of the Trace Event Format.
PHASES: frozenset[str] = frozenset("BEXiICbnestfPNODMVvRc")

_INSTANT_KINDS = {"sync": "t", "oom": "p"}  # kind -> instant scope
_METADATA_NAMES = {"process_name", "thread_name", "process_sort_index", "thread_sort_index", "process_labels"}
_PROCESS_METADATA = {"process_name", "process_sort_index", "process_labels"}
_NS_PER_US = 1000.0


def _pid(device: int) -> int:
    return device if device >= 0 else HOST_PID


def _tid_map(events: list[KernelEvent]) -> dict[str, int]:
    tids = dict(ENGINE_TIDS)
    unknown = sorted({e.engine for e in events} - set(tids))
    for i, engine in enumerate(unknown):
        tids[engine] = len(ENGINE_TIDS) + 1 + i
    return tids


def _estimate_note(profile: str | None) -> str:
    return f"roofline ESTIMATE for {profile or 'the device profile'}, not a measurement"


def _args(e: KernelEvent, profile: str | None, note: str | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {"seq": e.seq, "kind": e.kind, "device": e.device_name}
    if e.shapes:
        args["shapes"] = e.shapes
    if e.dtypes:
        args["dtypes"] = e.dtypes
    args["bytes_read"] = e.bytes_read
    args["bytes_written"] = e.bytes_written
    if e.flops:
        args["flops"] = e.flops
    if e.direction:
        args["direction"] = e.direction
    args["new_signature"] = e.new_signature
    if e.subgraph >= 0:
        args["subgraph"] = e.subgraph
    args["thread"] = e.thread
    if e.location:
        args["source"] = e.location
    if e.est_ns is not None:
        args["estimate_us"] = e.est_ns / _NS_PER_US
        args["estimate_note"] = note if note is not None else _estimate_note(profile)
    return args


def to_chrome_trace(
    events: Trace | Iterable[KernelEvent],
    metadata: Mapping[str, Any] | None = None,
    *,
    relative: bool = True,
) -> dict[str, Any]:
    """Convert events to a Chrome Trace Event Format dict (JSON Object Format).

    Args:
        events: a :class:`Trace` (its :meth:`Trace.info` becomes metadata) or any iterable of events.
        metadata: extra JSON-serialisable metadata for ``otherData`` (overrides the trace's).
        relative: make ``ts`` relative to the earliest event (``otherData.t0_ns`` keeps the origin);
            False keeps the recorder's absolute steady-clock times (converted to microseconds).

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}``.
    """
    gc_was = gc.isenabled()
    gc.disable()  # a million new dicts, none cyclic: collecting while building them is wasted work
    try:
        return _to_chrome_trace(events, metadata, relative)
    finally:
        if gc_was:
            gc.enable()


def _to_chrome_trace(
    events: Trace | Iterable[KernelEvent], metadata: Mapping[str, Any] | None, relative: bool
) -> dict[str, Any]:
    if isinstance(events, Trace):
        info: dict[str, Any] = events.info()
        evs = list(events.events)
    else:
        info = {}
        evs = list(events)
    info.update(metadata or {})
    note = _estimate_note(info.get("profile"))
    profile = info.get("profile")

    launched = [e for e in evs if e.host_end_ns > 0]
    if not launched:  # a synchronous trace: device processes only, syncs as instants (the old layout)
        t0 = min((e.start_ns for e in evs), default=0) if relative else 0
        out = _device_layout(evs, profile, note, t0)
    else:
        t0 = min([e.start_ns for e in evs] + [e.host_start_ns for e in launched]) if relative else 0
        out = _async_layout(evs, profile, note, t0)

    other = {"generator": "torchneuron_lab", "clock": "steady_clock_ns", "t0_ns": t0, **info}
    return {"traceEvents": out, "displayTimeUnit": "ns", "otherData": other}


def _device_layout(evs: list[KernelEvent], profile: str | None, note: str, t0: int) -> list[dict[str, Any]]:
    tids = _tid_map(evs)
    out: list[dict[str, Any]] = []

    # Metadata events: process per device, thread per engine lane actually used.
    for dev in sorted({e.device for e in evs}):
        pid = _pid(dev)
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": device_name(dev)}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for engine in sorted({e.engine for e in evs if e.device == dev}, key=lambda x: tids[x]):
            tid = tids[engine]
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": engine}})
            out.append(
                {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )

    for e in sorted(evs, key=lambda x: (x.start_ns, x.seq)):
        out.append(_slice(e, _pid(e.device), tids[e.engine], t0, profile, note))
    return out


def _slice(e: KernelEvent, pid: int, tid: int, t0: int, profile: str | None, note: str) -> dict[str, Any]:
    cat = e.kind + (",new_signature" if e.new_signature else "")
    base: dict[str, Any] = {
        "name": e.name,
        "cat": cat,
        "pid": pid,
        "tid": tid,
        "ts": (e.start_ns - t0) / _NS_PER_US,
        "args": _args(e, profile, note),
    }
    if e.kind in _INSTANT_KINDS or (e.kind == "marker" and e.dur_ns == 0):
        base["ph"] = "i"
        base["s"] = _INSTANT_KINDS.get(e.kind, "t")
        if e.dur_ns:
            base["args"]["wait_us"] = e.dur_ns / _NS_PER_US
    else:
        base["ph"] = "X"
        base["dur"] = e.dur_ns / _NS_PER_US
    return base


def _flow_id(e: KernelEvent) -> int:
    return e.correlation if e.correlation > 0 else FLOW_ID_BASE + e.seq


def _async_layout(evs: list[KernelEvent], profile: str | None, note: str, t0: int) -> list[dict[str, Any]]:
    """Host process (launches, syncs) + device processes with a track per stream x engine + flows."""
    tids = _tid_map(evs)
    host_side = [e for e in evs if e.kind == "sync" or e.device < 0]
    on_device = [e for e in evs if not (e.kind == "sync" or e.device < 0)]
    launched = [e for e in on_device if e.host_end_ns > 0]

    def dev_tid(e: KernelEvent) -> int:
        return max(e.stream, 0) * STREAM_TID_STRIDE + tids[e.engine]

    out: list[dict[str, Any]] = []
    host_threads = sorted({e.thread for e in host_side} | {e.thread for e in launched})
    out.append({"ph": "M", "name": "process_name", "pid": HOST_PID, "args": {"name": "host"}})
    out.append({"ph": "M", "name": "process_sort_index", "pid": HOST_PID, "args": {"sort_index": -1}})
    for i, th in enumerate(host_threads):
        out.append({"ph": "M", "name": "thread_name", "pid": HOST_PID, "tid": th,
                    "args": {"name": f"host thread {th}"}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": HOST_PID, "tid": th, "args": {"sort_index": i}})
    for dev in sorted({e.device for e in on_device}):
        out.append({"ph": "M", "name": "process_name", "pid": dev, "args": {"name": device_name(dev)}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": dev, "args": {"sort_index": dev}})
        tracks = sorted({(max(e.stream, 0), e.engine) for e in on_device if e.device == dev},
                        key=lambda k: (k[0], tids[k[1]]))
        for stream, engine in tracks:
            tid = stream * STREAM_TID_STRIDE + tids[engine]
            name = engine if stream == 0 else f"{engine} · stream {stream}"
            out.append({"ph": "M", "name": "thread_name", "pid": dev, "tid": tid, "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": dev, "tid": tid, "args": {"sort_index": tid}})

    timed: list[tuple[int, int, int, dict[str, Any]]] = []  # (time ns, rank, seq, event)
    for e in host_side:
        ev = _slice(e, HOST_PID, e.thread, t0, profile, note)
        if e.kind == "sync":
            ev["args"]["stream"] = e.stream
            ev["args"]["wait_us"] = e.dur_ns / _NS_PER_US
            if e.dur_ns > 0:  # the host waited: a slice on its track
                ev.pop("s", None)
                ev["ph"] = "X"
                ev["dur"] = e.dur_ns / _NS_PER_US
        timed.append((e.start_ns, 2, e.seq, ev))
    for e in on_device:
        ev = _slice(e, e.device, dev_tid(e), t0, profile, note)
        ev["args"]["stream"] = e.stream
        if e.host_end_ns > 0:
            ev["args"]["correlation"] = e.correlation
            ev["args"]["queued_us"] = (e.start_ns - e.host_end_ns) / _NS_PER_US
        timed.append((e.start_ns, 2, e.seq, ev))
    for e in launched:
        fid = _flow_id(e)
        launch_args = {"seq": e.seq, "correlation": e.correlation, "device": e.device_name, "stream": e.stream}
        if e.location:
            launch_args["source"] = e.location
        timed.append((e.host_start_ns, 0, e.seq, {
            "name": e.name, "cat": "launch", "ph": "X", "pid": HOST_PID, "tid": e.thread,
            "ts": (e.host_start_ns - t0) / _NS_PER_US, "dur": (e.host_end_ns - e.host_start_ns) / _NS_PER_US,
            "args": launch_args,
        }))
        mid_launch = (e.host_start_ns + e.host_end_ns) / 2
        mid_kernel = (e.start_ns + e.end_ns) / 2
        timed.append((e.host_start_ns, 1, e.seq, {
            "name": "launch", "cat": "launch", "ph": "s", "id": fid, "bp": "e", "pid": HOST_PID, "tid": e.thread,
            "ts": (mid_launch - t0) / _NS_PER_US,
        }))
        timed.append((e.start_ns, 3, e.seq, {
            "name": "launch", "cat": "launch", "ph": "f", "id": fid, "bp": "e", "pid": e.device,
            "tid": dev_tid(e), "ts": (mid_kernel - t0) / _NS_PER_US,
        }))
    timed.sort(key=lambda x: (x[0], x[1], x[2]))
    out.extend(ev for _, _, _, ev in timed)
    return out


def _is_number(x: Any) -> bool:
    t = type(x)
    if t is float:  # the common cases first: a trace has millions of these
        return x - x == 0.0  # False for inf and nan
    if t is int:
        return True
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_id(x: Any) -> bool:
    t = type(x)
    if t is int or t is str:
        return True
    return (isinstance(x, int) and not isinstance(x, bool)) or isinstance(x, str)


def chrome_trace_problems(obj: Any, *, check_json: bool = True) -> list[str]:
    """Every format problem found in ``obj`` (empty list: valid). See :func:`validate_chrome_trace`.

    ``check_json=False`` skips the strict-JSON check (for a caller that serialises with
    ``allow_nan=False`` itself, as :func:`write_chrome_trace` does)."""
    problems: list[str] = []
    if isinstance(obj, list):  # JSON Array Format
        events: Any = obj
    elif isinstance(obj, Mapping):
        if "traceEvents" not in obj:
            return ["missing key 'traceEvents'"]
        events = obj["traceEvents"]
        if not isinstance(events, list):
            return [f"'traceEvents' must be a list, got {type(events).__name__}"]
        unit = obj.get("displayTimeUnit")
        if unit is not None and unit not in ("ms", "ns"):
            problems.append(f"displayTimeUnit must be 'ms' or 'ns', got {unit!r}")
        if "otherData" in obj and not isinstance(obj["otherData"], Mapping):
            problems.append("'otherData' must be an object")
    else:
        return [f"a trace must be an object or a list of events, got {type(obj).__name__}"]

    flow_starts: set[tuple[Any, Any, Any]] = set()
    flow_ends: list[tuple[int, tuple[Any, Any, Any]]] = []
    for i, ev in enumerate(events):
        where = i  # formatted only into a problem's message
        if not isinstance(ev, Mapping):
            problems.append(f"traceEvents[{where}]: event must be an object, got {type(ev).__name__}")
            continue
        ph = ev.get("ph")
        if not isinstance(ph, str) or ph not in PHASES:
            problems.append(f"traceEvents[{where}]: 'ph' must be one of {''.join(sorted(PHASES))}, got {ph!r}")
            continue
        name = ev.get("name")
        if ph != "E" and not isinstance(name, str):
            problems.append(f"traceEvents[{where}]: 'name' must be a string, got {name!r}")
        if not _is_id(ev.get("pid")):
            problems.append(f"traceEvents[{where}]: 'pid' must be an int or string, got {ev.get('pid')!r}")
        tid_optional = (ph == "M" and name in _PROCESS_METADATA) or ph == "C" or (
            ph in "iI" and ev.get("s") in ("g", "p")
        )
        if ("tid" in ev or not tid_optional) and not _is_id(ev.get("tid")):
            problems.append(f"traceEvents[{where}]: 'tid' must be an int or string, got {ev.get('tid')!r}")
        if "args" in ev and not isinstance(ev["args"], Mapping):
            problems.append(f"traceEvents[{where}]: 'args' must be an object")
        if ph == "M":
            if name not in _METADATA_NAMES:
                problems.append(f"traceEvents[{where}]: metadata event name must be one of {sorted(_METADATA_NAMES)}, got {name!r}")
            args = ev.get("args")
            if not isinstance(args, Mapping):
                problems.append(f"traceEvents[{where}]: metadata event needs an 'args' object")
            elif name in ("process_name", "thread_name") and not isinstance(args.get("name"), str):
                problems.append(f"traceEvents[{where}]: {name} needs args.name as a string")
            elif name in ("process_sort_index", "thread_sort_index") and not (
                isinstance(args.get("sort_index"), int) and not isinstance(args.get("sort_index"), bool)
            ):
                problems.append(f"traceEvents[{where}]: {name} needs args.sort_index as an int")
            continue
        if not _is_number(ev.get("ts")):
            problems.append(f"traceEvents[{where}]: 'ts' must be a finite number (microseconds), got {ev.get('ts')!r}")
        if ph == "X":
            dur: Any = ev.get("dur")
            if not _is_number(dur):
                problems.append(f"traceEvents[{where}]: complete event needs a finite number 'dur', got {dur!r}")
            elif dur < 0:
                problems.append(f"traceEvents[{where}]: 'dur' must be >= 0, got {dur!r}")
        if ph in ("i", "I") and "s" in ev and ev["s"] not in ("g", "p", "t"):
            problems.append(f"traceEvents[{where}]: instant scope 's' must be 'g', 'p' or 't', got {ev['s']!r}")
        if ph in ("s", "t", "f"):
            if not _is_id(ev.get("id")):
                problems.append(f"traceEvents[{where}]: flow event needs an int or string 'id', got {ev.get('id')!r}")
            elif ph == "s":
                flow_starts.add((ev.get("cat"), name, ev["id"]))
            elif ph == "f":
                flow_ends.append((where, (ev.get("cat"), name, ev["id"])))
            if "bp" in ev and ev["bp"] != "e":
                problems.append(f"traceEvents[{where}]: flow binding point 'bp' must be 'e', got {ev['bp']!r}")

    for where, key in flow_ends:
        if key not in flow_starts:
            problems.append(f"traceEvents[{where}]: flow end without a flow start of the same cat, name and id {key[2]!r}")
    if check_json:
        try:
            json.dumps(obj, allow_nan=False)
        except (TypeError, ValueError) as exc:
            problems.append(f"not JSON-serialisable: {exc}")
    return problems


def validate_chrome_trace(obj: Any, *, check_json: bool = True) -> None:
    """Check ``obj`` against the Chrome Trace Event Format; raise if anything is wrong.

    Checked: the container (object with a ``traceEvents`` list, or a bare list), ``displayTimeUnit``,
    each event's ``ph`` (a known phase), ``name``, ``pid``/``tid`` types, finite ``ts`` in
    microseconds, complete events' non-negative ``dur``, instant scopes, metadata events' names and
    args, ``args`` being an object, and the whole being strict JSON (no NaN/Infinity).

    Raises:
        ValueError: listing the problems found (up to 20, with the total count).
    """
    problems = chrome_trace_problems(obj, check_json=check_json)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(f"invalid Chrome trace ({len(problems)} problem(s)):\n  {shown}{more}")


def write_chrome_trace(
    path: str | os.PathLike[str],
    events: Trace | Iterable[KernelEvent],
    metadata: Mapping[str, Any] | None = None,
    *,
    relative: bool = True,
) -> Path:
    """Write events as a Chrome trace JSON file (gzip-compressed when ``path`` ends in '.gz').

    The trace is validated before anything is written. Returns the path written.
    """
    trace = to_chrome_trace(events, metadata, relative=relative)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        validate_chrome_trace(trace, check_json=False)
        try:
            return write_atomically(path, lambda fh: _dump_in_chunks(trace, fh))
        except (TypeError, ValueError) as exc:  # the strict-JSON check is this dump
            raise ValueError(f"invalid Chrome trace (1 problem(s)):\n  not JSON-serialisable: {exc}") from None
    finally:
        if gc_was:
            gc.enable()


def write_atomically(path: str | os.PathLike[str], write: Callable[[Any], None]) -> Path:
    """Call ``write(fh)`` with a binary file for ``path`` (gzip-compressed when it ends in '.gz'); return the path.

    A regular file (or a new one) is written next to itself and renamed into place, so a failure (an
    exception from ``write``, a full disk, Ctrl-C) leaves no file, or the old one untouched. Anything else
    (a symlink, /dev/stdout, a FIFO) is written directly. The new file gets the umask's permissions (not
    ``mkstemp``'s 0600), or the old file's.
    """
    p = Path(path)
    direct = p.is_symlink() or (p.exists() and not p.is_file())
    tmp: Path | None = None
    if direct:
        raw = open(p, "wb")  # noqa: SIM115 - closed below
    else:
        fd, name = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        tmp, raw = Path(name), os.fdopen(fd, "wb")
    try:
        with raw:
            if p.suffix == ".gz":  # the header names the target, not the temporary file
                with gzip.GzipFile(filename=p.name[:-3], mode="wb", fileobj=raw) as gz:
                    write(gz)
            else:
                write(raw)
        if tmp is not None:
            os.chmod(tmp, p.stat().st_mode & 0o777 if p.exists() else 0o666 & ~_umask())
            os.replace(tmp, p)
            tmp = None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return p


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


# Events serialised per chunk: a 1M-event trace as one string was ~870 MB, then as many bytes again.
_CHUNK_EVENTS = 20_000


def _dump_in_chunks(trace: dict[str, Any], fh: Any, chunk: int | None = None) -> None:
    """``json.dumps(trace)`` (compact, strict) written to ``fh`` a slice of ``traceEvents`` at a time."""
    n = chunk or _CHUNK_EVENTS
    events = trace["traceEvents"]
    rest = {k: v for k, v in trace.items() if k != "traceEvents"}
    fh.write(b'{"traceEvents":[')
    for i in range(0, len(events), n):
        text = json.dumps(events[i:i + n], allow_nan=False, separators=(",", ":"))
        if i:
            fh.write(b",")
        fh.write(text[1:-1].encode("utf-8"))
    tail = json.dumps(rest, allow_nan=False, separators=(",", ":"))
    fh.write(b"]" + (b"," + tail[1:].encode("utf-8") if rest else b"}"))
