"""Plain-data view of the kernel recorder: :class:`KernelEvent`, :class:`Trace` and converters.

The C++ recorder returns a dict of equal-length column lists (``_C.recorder_read()``, see
notes/api.md). :func:`events_from_columns` turns it into a list of frozen :class:`KernelEvent`
dataclasses; :func:`events_to_columns` goes back; :func:`to_dataframe` builds a pandas DataFrame
(pandas is imported only when called). :class:`Trace` holds events plus recording metadata and
filters them.

The fast path: :class:`RecordedColumns` holds the recorder's packed columns (numpy arrays, ids into
tables of interned strings and stacks, as ``_C.recorder_read_columns()`` returns them). A
:class:`Trace` built with :meth:`Trace.from_recorded` materialises its :class:`KernelEvent` list only
when ``trace.events`` is first used, and shares one tuple of frames and one string per distinct stack
and name.

This module imports no other layer of the package and neither torch, numpy nor pandas at import time.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "COLUMNS",
    "DATAFRAME_COLUMNS",
    "DIRECTIONS",
    "ENGINES",
    "EXTRA_COLUMNS",
    "KINDS",
    "REQUIRED_COLUMNS",
    "KernelEvent",
    "RecordedColumns",
    "StackFrame",
    "Trace",
    "device_name",
    "events_from_columns",
    "events_to_columns",
    "parse_device",
    "to_dataframe",
]

#: Event kinds. 'kernel', 'dma', 'sync', 'marker' come from the C++ recorder; 'compile' and 'oom' are
#: pushed from Python (compiler layer, allocator OOM hook). Unknown kinds are kept, not rejected.
KINDS: tuple[str, ...] = ("kernel", "dma", "sync", "marker", "compile", "oom")
#: Engine classes, in display order.
ENGINES: tuple[str, ...] = ("tensor", "vector", "scalar", "gpsimd", "dma", "host")
#: DMA directions ('' for non-DMA events).
DIRECTIONS: tuple[str, ...] = ("h2d", "d2h", "d2d")

#: Recorder columns, in the order of notes/api.md.
COLUMNS: tuple[str, ...] = (
    "seq", "kind", "name", "device", "engine", "start_ns", "end_ns", "bytes_read", "bytes_written",
    "flops", "new_signature", "shapes", "dtypes", "direction", "subgraph", "thread", "stack",
)
#: Columns added on the Python side (never produced by the recorder itself).
EXTRA_COLUMNS: tuple[str, ...] = ("est_ns", "source")
#: Columns :func:`events_from_columns` cannot do without.
REQUIRED_COLUMNS: tuple[str, ...] = ("kind", "name", "device", "engine", "start_ns", "end_ns")

_SHAPE_RE = re.compile(r"\[([^\[\]]*)\]")


@dataclass(frozen=True)
class StackFrame:
    """One Python frame of the host-side call that launched an event."""

    filename: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.line} in {self.name}"

    def as_dict(self) -> dict[str, Any]:
        """``{"filename", "line", "name"}``, the recorder's own format."""
        return {"filename": self.filename, "line": self.line, "name": self.name}


@dataclass(frozen=True)
class KernelEvent:
    """One recorded event (kernel, DMA transfer, sync, marker, compile step or OOM).

    Times are steady-clock nanoseconds (``_C.now_ns()``'s clock). Fields mirror the recorder columns
    of notes/api.md, plus two filled on the Python side:

    Attributes:
        seq: recorder sequence number (monotonic per recording).
        kind: 'kernel' | 'dma' | 'sync' | 'marker' | 'compile' | 'oom'.
        name: op or kernel name, e.g. 'aten::add.Tensor'.
        device: device index (``neuron:<device>``).
        engine: 'tensor' | 'vector' | 'scalar' | 'gpsimd' | 'dma' | 'host'.
        start_ns, end_ns: start and end time; ``end_ns >= start_ns``.
        bytes_read, bytes_written: device-memory traffic of the event.
        flops: floating-point operations where defined, else 0.
        new_signature: first time this op signature was seen on the device (a NEFF compile on Trainium).
        shapes: input shapes as the recorder prints them, e.g. '[4, 4], [4]' ('' when not recorded).
        dtypes: input dtypes, e.g. 'float32, float32' ('' when not recorded).
        direction: 'h2d' | 'd2h' | 'd2d' for DMA events, '' otherwise.
        subgraph: compiled subgraph id, -1 for eager.
        thread: host thread id that issued the event.
        stack: host Python frames, innermost last (empty when stacks were not recorded).
        est_ns: roofline ESTIMATE of the event's time on the device profile, or None (never measured).
        source: notebook location of the call, e.g. 'cell [3], line 2', or None.
    """

    seq: int
    kind: str
    name: str
    device: int
    engine: str
    start_ns: int
    end_ns: int
    bytes_read: int = 0
    bytes_written: int = 0
    flops: int = 0
    new_signature: bool = False
    shapes: str = ""
    dtypes: str = ""
    direction: str = ""
    subgraph: int = -1
    thread: int = 0
    stack: tuple[StackFrame, ...] = ()
    est_ns: float | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        if self.end_ns < self.start_ns:
            raise ValueError(
                f"event seq={self.seq} {self.name!r}: end_ns ({self.end_ns}) is before start_ns "
                f"({self.start_ns})"
            )

    @property
    def dur_ns(self) -> int:
        """Measured duration, ``end_ns - start_ns``."""
        return self.end_ns - self.start_ns

    @property
    def bytes_total(self) -> int:
        """``bytes_read + bytes_written``."""
        return self.bytes_read + self.bytes_written

    @property
    def device_name(self) -> str:
        """'neuron:<device>' (or 'host' for a negative device index)."""
        return device_name(self.device)

    @property
    def is_compiled(self) -> bool:
        """True for fused kernels of a compiled subgraph (``subgraph >= 0``)."""
        return self.subgraph >= 0

    @property
    def shape_list(self) -> list[tuple[int, ...]]:
        """``shapes`` parsed: '[4, 4], [4]' -> [(4, 4), (4,)]; '[]' -> [()] (a 0-d tensor)."""
        out: list[tuple[int, ...]] = []
        for inner in _SHAPE_RE.findall(self.shapes):
            dims = [d.strip() for d in inner.split(",") if d.strip()]
            out.append(tuple(int(d) for d in dims))
        return out

    @property
    def dtype_list(self) -> list[str]:
        """``dtypes`` split: 'float32, int64' -> ['float32', 'int64']."""
        return [d.strip() for d in self.dtypes.split(",") if d.strip()]

    @property
    def location(self) -> str | None:
        """``source`` if set, else the innermost stack frame as 'file:line in func', else None."""
        if self.source:
            return self.source
        if self.stack:
            return str(self.stack[-1])
        return None

    def as_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (stack as a list of frame dicts, as the recorder returns it)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["stack"] = [fr.as_dict() for fr in self.stack]
        return d


_EVENT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KernelEvent))


def _trusted_event(values: tuple[Any, ...]) -> KernelEvent:
    """A :class:`KernelEvent` from values in field order, already converted and checked (the recorder's
    own columns): sets the fields directly, skipping the frozen ``__setattr__`` and ``__post_init__``."""
    ev = object.__new__(KernelEvent)
    ev.__dict__.update(zip(_EVENT_FIELDS, values))
    return ev


@dataclass
class RecordedColumns:
    """The recorder's contents as packed columns plus the tables their ids index.

    Numeric columns are numpy arrays of one length ``n``. ``name``/``shapes``/``dtypes`` are ids into
    ``strings`` (-1: ''); ``kind``/``engine``/``direction`` index ``kinds``/``engines``/``directions``;
    ``stack`` indexes ``stack_frames`` and ``stack_sources`` (negative: no stack). ``est_ns`` is a float
    array with NaN where there is no estimate. Build :class:`KernelEvent` objects with :meth:`events`
    (or a :class:`Trace` with :meth:`Trace.from_recorded`); nothing is materialised before.
    """

    n: int
    arrays: dict[str, Any]
    strings: Sequence[str]
    kinds: Sequence[str] = KINDS[:4]
    engines: Sequence[str] = ENGINES
    directions: Sequence[str] = ("", *DIRECTIONS)
    stack_frames: Sequence[tuple[StackFrame, ...]] = ()
    stack_sources: Sequence[str | None] = ()

    _NUMERIC: ClassVar[tuple[tuple[str, str], ...]] = (
        ("seq", "<i8"), ("kind", "u1"), ("engine", "u1"), ("direction", "u1"), ("new_signature", "u1"),
        ("device", "i1"), ("name", "<i4"), ("shapes", "<i4"), ("dtypes", "<i4"), ("subgraph", "<i4"),
        ("start_ns", "<i8"), ("end_ns", "<i8"), ("bytes_read", "<i8"), ("bytes_written", "<i8"),
        ("flops", "<i8"), ("thread", "<i8"), ("stack", "<i4"),
    )

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> RecordedColumns:
        """Wrap ``_C.recorder_read_columns()`` (packed bytes per column) without copying the columns."""
        import numpy as np

        n = int(raw["n"])
        arrays = {name: np.frombuffer(raw[name], dtype=dt, count=n) for name, dt in cls._NUMERIC}
        return cls(n=n, arrays=arrays, strings=list(raw["strings"]), kinds=tuple(raw["kinds"]),
                   engines=tuple(raw["engines"]), directions=tuple(raw["directions"]))

    def __len__(self) -> int:
        return self.n

    def _strings_of(self, ids: Any) -> list[str]:
        table = [*self.strings, ""]  # id -1 -> ''
        return [table[i] for i in ids.tolist()]

    def events(self) -> list[KernelEvent]:
        """Materialise the :class:`KernelEvent` list (strings and frames shared, not copied).

        Raises:
            ValueError: an event ends before it starts (only possible for events pushed from Python).
        """
        import numpy as np

        a = self.arrays
        start, end = a["start_ns"], a["end_ns"]
        bad = np.flatnonzero(end < start)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"event seq={int(a['seq'][i])} {self._strings_of(a['name'][i:i + 1])[0]!r}: end_ns "
                f"({int(end[i])}) is before start_ns ({int(start[i])})"
            )
        n = self.n
        kinds, engines, directions = list(self.kinds), list(self.engines), list(self.directions)
        stack_ids = a["stack"].tolist()
        frames = [*self.stack_frames, ()]
        sources = [*self.stack_sources, None]
        n_stacks = len(self.stack_frames)
        stack_ix = [i if 0 <= i < n_stacks else n_stacks for i in stack_ids]
        est = a.get("est_ns")
        est_list: list[Any] = [None] * n if est is None else [
            None if math.isnan(v) else v for v in est.tolist()
        ]
        columns = (
            a["seq"].tolist(),
            [kinds[k] for k in a["kind"].tolist()],
            self._strings_of(a["name"]),
            a["device"].tolist(),
            [engines[k] for k in a["engine"].tolist()],
            start.tolist(),
            end.tolist(),
            a["bytes_read"].tolist(),
            a["bytes_written"].tolist(),
            a["flops"].tolist(),
            [bool(v) for v in a["new_signature"].tolist()],
            self._strings_of(a["shapes"]),
            self._strings_of(a["dtypes"]),
            [directions[k] for k in a["direction"].tolist()],
            a["subgraph"].tolist(),
            a["thread"].tolist(),
            [frames[i] for i in stack_ix],
            est_list,
            [sources[i] for i in stack_ix],
        )
        gc_was = gc.isenabled()
        gc.disable()  # millions of new objects, none cyclic: collecting while building them is wasted work
        try:
            return [_trusted_event(row) for row in zip(*columns)]
        finally:
            if gc_was:
                gc.enable()


def device_name(device: int) -> str:
    """'neuron:<device>' for ``device >= 0``, 'host' otherwise."""
    return f"neuron:{device}" if device >= 0 else "host"


def parse_device(device: int | str) -> int:
    """Accept ``1``, ``'1'``, ``'neuron:1'`` (or a ``torch.device``) and return the index 1.

    Raises:
        ValueError: for another device type or a malformed string.
    """
    if isinstance(device, bool):
        raise TypeError("device must be an int or a 'neuron:N' string, not a bool")
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    dev_type = getattr(device, "type", None)
    if dev_type is not None:  # torch.device, duck-typed so that torch is not imported
        if dev_type != "neuron":
            raise ValueError(f"expected a neuron device, got {device!r}")
        return 0 if index is None else int(index)
    text = str(device).strip().removeprefix("neuron:")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"cannot read a device index from {device!r}; use an int or 'neuron:N'") from None


def _frames(raw: Any) -> tuple[StackFrame, ...]:
    if not raw:
        return ()
    frames = []
    for fr in raw:
        if isinstance(fr, StackFrame):
            frames.append(fr)
        elif isinstance(fr, Mapping):
            frames.append(StackFrame(str(fr.get("filename", "")), int(fr.get("line", 0)), str(fr.get("name", ""))))
        else:
            raise TypeError(f"stack frame must be a dict(filename, line, name), got {type(fr).__name__}")
    return tuple(frames)


def events_from_columns(cols: Mapping[str, Sequence[Any]]) -> list[KernelEvent]:
    """Build events from the recorder's column dict (``_C.recorder_read()``).

    Every column must have the same length. :data:`REQUIRED_COLUMNS` must be present; other recorder
    columns default to the :class:`KernelEvent` defaults (``seq`` to the row index), and the optional
    ``est_ns`` / ``source`` columns are read when present. Unknown columns are ignored so that a newer
    recorder does not break an older reader.

    Raises:
        ValueError: a required column is missing, or the columns differ in length.
        TypeError: ``cols`` is not a mapping.
    """
    if not isinstance(cols, Mapping):
        raise TypeError(f"expected a dict of columns, got {type(cols).__name__}")
    missing = [c for c in REQUIRED_COLUMNS if c not in cols]
    if missing:
        raise ValueError(f"recorder columns missing: {', '.join(missing)} (required: {', '.join(REQUIRED_COLUMNS)})")
    known = [c for c in (*COLUMNS, *EXTRA_COLUMNS) if c in cols]
    lengths = {c: len(cols[c]) for c in known}
    if len(set(lengths.values())) > 1:
        detail = ", ".join(f"{c}={n}" for c, n in lengths.items())
        raise ValueError(f"recorder columns have different lengths: {detail}")
    n = next(iter(lengths.values()))

    def col(name: str) -> Sequence[Any] | None:
        return cols.get(name)

    seq, b_read, b_written, flops = col("seq"), col("bytes_read"), col("bytes_written"), col("flops")
    new_sig, shapes, dtypes, direction = col("new_signature"), col("shapes"), col("dtypes"), col("direction")
    subgraph, thread, stack, est, source = col("subgraph"), col("thread"), col("stack"), col("est_ns"), col("source")
    kind, name, device, engine = cols["kind"], cols["name"], cols["device"], cols["engine"]
    start, end = cols["start_ns"], cols["end_ns"]

    events: list[KernelEvent] = []
    for i in range(n):
        est_i = est[i] if est is not None else None
        src_i = source[i] if source is not None else None
        events.append(
            KernelEvent(
                seq=int(seq[i]) if seq is not None else i,
                kind=str(kind[i]),
                name=str(name[i]),
                device=int(device[i]),
                engine=str(engine[i]),
                start_ns=int(start[i]),
                end_ns=int(end[i]),
                bytes_read=int(b_read[i]) if b_read is not None else 0,
                bytes_written=int(b_written[i]) if b_written is not None else 0,
                flops=int(flops[i]) if flops is not None else 0,
                new_signature=bool(new_sig[i]) if new_sig is not None else False,
                shapes=str(shapes[i]) if shapes is not None else "",
                dtypes=str(dtypes[i]) if dtypes is not None else "",
                direction=str(direction[i]) if direction is not None else "",
                subgraph=int(subgraph[i]) if subgraph is not None else -1,
                thread=int(thread[i]) if thread is not None else 0,
                stack=_frames(stack[i]) if stack is not None else (),
                est_ns=None if est_i is None else float(est_i),
                source=None if src_i is None else str(src_i),
            )
        )
    return events


def events_to_columns(events: Iterable[KernelEvent]) -> dict[str, list[Any]]:
    """Inverse of :func:`events_from_columns`: all :data:`COLUMNS` plus ``est_ns`` and ``source``."""
    evs = list(events)
    out: dict[str, list[Any]] = {}
    for c in (*COLUMNS, *EXTRA_COLUMNS):
        if c == "stack":
            out[c] = [[fr.as_dict() for fr in e.stack] for e in evs]
        else:
            out[c] = [getattr(e, c) for e in evs]
    return out


#: DataFrame columns of :func:`to_dataframe`, in order.
DATAFRAME_COLUMNS: tuple[str, ...] = (
    *COLUMNS[:7], "dur_ns", *COLUMNS[7:10], "bytes_total", *COLUMNS[10:], *EXTRA_COLUMNS, "location",
)


def to_dataframe(events: Iterable[KernelEvent]) -> pd.DataFrame:
    """One row per event: the recorder columns plus ``dur_ns``, ``bytes_total``, ``est_ns``,
    ``source`` and ``location``. Needs pandas (imported here, not at module import).

    Raises:
        ModuleNotFoundError: pandas is not installed (with the install hint).
    """
    try:
        import pandas as pd
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "to_dataframe needs pandas: pip install pandas (or torchneuron-lab[jupyter])"
        ) from exc
    rows = []
    for e in events:
        d = e.as_dict()
        d["dur_ns"] = e.dur_ns
        d["bytes_total"] = e.bytes_total
        d["location"] = e.location
        rows.append(d)
    return pd.DataFrame(rows, columns=list(DATAFRAME_COLUMNS))


def _as_set(value: Any, what: str) -> set[Any] | None:
    if value is None:
        return None
    if isinstance(value, (str, int)) or not isinstance(value, Iterable):
        return {value}
    values = set(value)
    if not values:
        raise ValueError(f"{what} filter is empty")
    return values


@dataclass
class Trace:
    """Recorded events plus recording metadata.

    Attributes:
        events: the events, in recorder order.
        profile: name of the device profile the estimates (if any) refer to, e.g. 'trn2'.
        dropped: events the recorder dropped because its ring buffer was full
            (``_C.recorder_dropped()``); non-zero means the trace is incomplete.
        metadata: free-form extra metadata (JSON-serialisable values), carried into exports.
    """

    events: list[KernelEvent] = field(default_factory=list)
    profile: str | None = None
    dropped: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_recorded(
        cls,
        cols: RecordedColumns,
        *,
        profile: str | None = None,
        dropped: int = 0,
        metadata: Mapping[str, Any] | None = None,
    ) -> Trace:
        """A trace over the recorder's packed columns; ``events`` is built on first use."""
        trace = cls([], profile=profile, dropped=int(dropped), metadata=dict(metadata or {}))
        trace.__dict__["events"] = _Deferred(cols)
        return trace

    @property
    def columns(self) -> RecordedColumns | None:
        """The packed columns this trace was read from (None for a trace built from events)."""
        pending = self.__dict__.get("events")
        if isinstance(pending, _Deferred):
            return pending.cols
        return self.__dict__.get("_columns")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["events"] = self.events  # materialised: the deferred builder is not picklable
        return state

    @classmethod
    def from_columns(
        cls,
        cols: Mapping[str, Sequence[Any]],
        *,
        profile: str | None = None,
        dropped: int = 0,
        metadata: Mapping[str, Any] | None = None,
    ) -> Trace:
        """Build a trace from the recorder's column dict (see :func:`events_from_columns`)."""
        return cls(events_from_columns(cols), profile=profile, dropped=int(dropped), metadata=dict(metadata or {}))

    def __len__(self) -> int:
        pending = self.__dict__.get("events")
        return len(pending.cols) if isinstance(pending, _Deferred) else len(self.events)

    def __iter__(self) -> Iterator[KernelEvent]:
        return iter(self.events)

    def __getitem__(self, index: int) -> KernelEvent:
        return self.events[index]

    def info(self) -> dict[str, Any]:
        """Metadata for exports: ``{"profile", "dropped", "num_events", **metadata}``."""
        return {"profile": self.profile, "dropped": self.dropped, "num_events": len(self.events), **self.metadata}

    # -- time extent ------------------------------------------------------------------------------
    @property
    def start_ns(self) -> int | None:
        """Earliest start, or None for an empty trace."""
        return min((e.start_ns for e in self.events), default=None)

    @property
    def end_ns(self) -> int | None:
        """Latest end, or None for an empty trace."""
        return max((e.end_ns for e in self.events), default=None)

    @property
    def span_ns(self) -> int:
        """``end_ns - start_ns`` (0 for an empty trace)."""
        s, e = self.start_ns, self.end_ns
        return 0 if s is None or e is None else e - s

    @property
    def devices(self) -> list[int]:
        """Device indices present, sorted."""
        return sorted({e.device for e in self.events})

    @property
    def engines(self) -> list[str]:
        """Engines present, in :data:`ENGINES` order (unknown engines last, sorted)."""
        present = {e.engine for e in self.events}
        return [x for x in ENGINES if x in present] + sorted(present - set(ENGINES))

    # -- filters ----------------------------------------------------------------------------------
    def _derive(self, events: list[KernelEvent]) -> Trace:
        return Trace(events, profile=self.profile, dropped=self.dropped, metadata=dict(self.metadata))

    def _check(self, values: set[Any] | None, known: tuple[str, ...], what: str) -> None:
        if values is None:
            return
        allowed = set(known) | {getattr(e, what) for e in self.events}
        bad = sorted(str(v) for v in values if v not in allowed)
        if bad:
            raise ValueError(f"unknown {what} {', '.join(map(repr, bad))}; expected one of {', '.join(known)}")

    def filter(
        self,
        *,
        kind: str | Iterable[str] | None = None,
        device: int | str | Iterable[int | str] | None = None,
        engine: str | Iterable[str] | None = None,
        name: str | Iterable[str] | None = None,
        start_ns: int | None = None,
        end_ns: int | None = None,
    ) -> Trace:
        """A new trace with the events matching every given criterion.

        Each criterion takes one value or an iterable of values. ``device`` accepts ``0`` or
        ``'neuron:0'``. ``start_ns`` / ``end_ns`` select the events that overlap the half-open window
        ``[start_ns, end_ns)`` (an instant event at ``t`` overlaps it when ``start_ns <= t < end_ns``).

        Raises:
            ValueError: an unknown kind or engine (one neither known nor present), or an empty filter.
        """
        kinds = _as_set(kind, "kind")
        engines = _as_set(engine, "engine")
        names = _as_set(name, "name")
        devs = _as_set(device, "device")
        devices = None if devs is None else {parse_device(d) for d in devs}
        self._check(kinds, KINDS, "kind")
        self._check(engines, ENGINES, "engine")
        if start_ns is not None and end_ns is not None and end_ns < start_ns:
            raise ValueError(f"time window ends ({end_ns}) before it starts ({start_ns})")

        def keep(e: KernelEvent) -> bool:
            if kinds is not None and e.kind not in kinds:
                return False
            if engines is not None and e.engine not in engines:
                return False
            if names is not None and e.name not in names:
                return False
            if devices is not None and e.device not in devices:
                return False
            if start_ns is not None and not (e.end_ns > start_ns or (e.dur_ns == 0 and e.start_ns >= start_ns)):
                return False
            return end_ns is None or e.start_ns < end_ns

        return self._derive([e for e in self.events if keep(e)])

    def by_kind(self, kind: str | Iterable[str]) -> Trace:
        """Events of the given kind(s)."""
        return self.filter(kind=kind)

    def by_device(self, device: int | str | Iterable[int | str]) -> Trace:
        """Events on the given device(s) (index or 'neuron:N')."""
        return self.filter(device=device)

    def by_engine(self, engine: str | Iterable[str]) -> Trace:
        """Events on the given engine class(es)."""
        return self.filter(engine=engine)

    def window(self, start_ns: int | None = None, end_ns: int | None = None) -> Trace:
        """Events overlapping ``[start_ns, end_ns)``; either bound may be None (open)."""
        return self.filter(start_ns=start_ns, end_ns=end_ns)

    def kernels(self) -> Trace:
        """Kernel events only (eager ops and fused compiled kernels)."""
        return self.filter(kind="kernel")

    def transfers(self) -> Trace:
        """DMA events only."""
        return self.filter(kind="dma")

    def syncs(self) -> Trace:
        """Sync events only."""
        return self.filter(kind="sync")

    # -- exports ----------------------------------------------------------------------------------
    def to_dataframe(self) -> pd.DataFrame:
        """See :func:`to_dataframe`."""
        return to_dataframe(self.events)

    def to_columns(self) -> dict[str, list[Any]]:
        """See :func:`events_to_columns`."""
        return events_to_columns(self.events)

    def to_chrome_trace(self, *, relative: bool = True) -> dict[str, Any]:
        """See :func:`torchneuron_lab.tracing.chrome_trace.to_chrome_trace`."""
        from torchneuron_lab.tracing.chrome_trace import to_chrome_trace

        return to_chrome_trace(self, relative=relative)


class _Deferred:
    """Placeholder for ``Trace.events`` until first use."""

    __slots__ = ("cols",)

    def __init__(self, cols: RecordedColumns) -> None:
        self.cols = cols


class _LazyEvents:
    """Data descriptor for ``Trace.events``: a plain list, built from packed columns on first access."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__.get("events")
        if isinstance(value, _Deferred):
            obj.__dict__["_columns"] = value.cols
            value = value.cols.events()
            obj.__dict__["events"] = value
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__["events"] = value
        obj.__dict__.pop("_columns", None)


Trace.events = _LazyEvents()  # type: ignore[assignment]  # after @dataclass, which reads the field
