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
    "ASYNC_COLUMNS",
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
    "stream", "host_start_ns", "host_end_ns", "correlation",
)
#: Recorder columns of the asynchronous device (issue 12), optional: a recorder that does not produce
#: them (a synchronous or older build) reads as if every value were the default given here.
ASYNC_COLUMNS: dict[str, int] = {"stream": 0, "host_start_ns": 0, "host_end_ns": 0, "correlation": 0}
#: Columns added on the Python side (never produced by the recorder itself).
EXTRA_COLUMNS: tuple[str, ...] = ("est_ns", "source")
#: Columns :func:`events_from_columns` cannot do without.
REQUIRED_COLUMNS: tuple[str, ...] = ("kind", "name", "device", "engine", "start_ns", "end_ns")

_SHAPE_RE = re.compile(r"\[([^\[\]]*)\]")


def displayable(text: str) -> str:
    """``text`` as valid Unicode: what UTF-8 cannot encode is written as a backslash escape.

    A file name that is not valid UTF-8 reaches Python as a str with lone surrogates (``os.fsdecode``);
    such a str cannot be printed to a UTF-8 terminal or written as JSON by orjson (plotly's and
    jupyter_client's encoder when installed). Bytes the file system escaped become ``\\xNN`` (the name
    ``b"s\\xffx.py"`` reads ``s\\xffx.py``), any other lone surrogate ``\\udNNN``.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class StackFrame:
    """One Python frame of the host-side call that launched an event.

    ``filename`` and ``name`` are :func:`displayable`: valid Unicode whatever the file system held.
    """

    filename: str
    line: int
    name: str

    def __post_init__(self) -> None:
        for attr in ("filename", "name"):
            value = getattr(self, attr)
            clean = displayable(value)
            if clean is not value:
                object.__setattr__(self, attr, clean)

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
        stream: stream id on its device for kernel/DMA events (0: the default stream); for a sync, the
            stream the host waited on (-1: the whole device).
        host_start_ns, host_end_ns: host-side span of the op call that LAUNCHED (enqueued) this kernel
            or DMA; 0 when unknown (synchronous or older traces). The kernel's own ``start_ns``/``end_ns``
            are its execution on the device, which can begin long after ``host_end_ns``.
        correlation: launch id linking the host launch to its device kernel (0: none).
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
    # the asynchronous device's columns come last, so that positional construction stays as it was
    stream: int = 0
    host_start_ns: int = 0
    host_end_ns: int = 0
    correlation: int = 0

    def __post_init__(self) -> None:
        if self.end_ns < self.start_ns:
            raise ValueError(
                f"event seq={self.seq} {self.name!r}: end_ns ({self.end_ns}) is before start_ns "
                f"({self.start_ns})"
            )
        if self.host_end_ns < self.host_start_ns:
            raise ValueError(
                f"event seq={self.seq} {self.name!r}: host_end_ns ({self.host_end_ns}) is before "
                f"host_start_ns ({self.host_start_ns})"
            )

    @property
    def has_launch(self) -> bool:
        """True when the host-side launch span is known (``host_end_ns > 0``)."""
        return self.host_end_ns > 0

    @property
    def launch_delay_ns(self) -> int | None:
        """Time from the end of the host launch to the start of execution (queueing), or None when the
        launch span is unknown."""
        return self.start_ns - self.host_end_ns if self.host_end_ns > 0 else None

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

    #: The optional columns of :data:`ASYNC_COLUMNS` and their packed dtypes.
    _OPTIONAL: ClassVar[tuple[tuple[str, str], ...]] = (
        ("stream", "<i4"), ("host_start_ns", "<i8"), ("host_end_ns", "<i8"), ("correlation", "<i8"),
    )

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> RecordedColumns:
        """Wrap ``_C.recorder_read_columns()`` (packed bytes per column) without copying the columns.

        The optional :data:`ASYNC_COLUMNS` are read when present (packed little-endian ints of 1, 2, 4 or
        8 bytes, or any sequence of ints); absent ones read as their defaults (:meth:`column`)."""
        import numpy as np

        n = int(raw["n"])
        arrays = {name: np.frombuffer(raw[name], dtype=dt, count=n) for name, dt in cls._NUMERIC}
        for name, dt in cls._OPTIONAL:
            if name in raw and raw[name] is not None:
                arrays[name] = _optional_array(raw[name], n, name, dt)
        return cls(n=n, arrays=arrays, strings=list(raw["strings"]), kinds=tuple(raw["kinds"]),
                   engines=tuple(raw["engines"]), directions=tuple(raw["directions"]))

    @classmethod
    def from_events(cls, events: Iterable[KernelEvent]) -> RecordedColumns:
        """Pack events as the recorder would (strings interned, stacks as ids): for tests and benchmarks
        of the columnar paths, and for traces built in Python."""
        import numpy as np

        evs = list(events)
        strings: dict[str, int] = {"": -1}
        kinds: dict[str, int] = {k: i for i, k in enumerate(KINDS)}
        engines: dict[str, int] = {g: i for i, g in enumerate(ENGINES)}
        directions: dict[str, int] = {d: i for i, d in enumerate(("", *DIRECTIONS))}
        stacks: dict[tuple[tuple[StackFrame, ...], str | None], int] = {}

        def sid(text: str) -> int:
            return strings.setdefault(text, len(strings) - 1)

        def stack_id(e: KernelEvent) -> int:
            if not e.stack and e.source is None:
                return -1
            return stacks.setdefault((e.stack, e.source), len(stacks))

        cols: dict[str, list[Any]] = {
            "seq": [e.seq for e in evs], "kind": [kinds.setdefault(e.kind, len(kinds)) for e in evs],
            "engine": [engines.setdefault(e.engine, len(engines)) for e in evs],
            "direction": [directions.setdefault(e.direction, len(directions)) for e in evs],
            "new_signature": [int(e.new_signature) for e in evs], "device": [e.device for e in evs],
            "name": [sid(e.name) for e in evs], "shapes": [sid(e.shapes) for e in evs],
            "dtypes": [sid(e.dtypes) for e in evs], "subgraph": [e.subgraph for e in evs],
            "stack": [stack_id(e) for e in evs],
        }
        for name in ("start_ns", "end_ns", "bytes_read", "bytes_written", "flops", "thread", *ASYNC_COLUMNS):
            cols[name] = [getattr(e, name) for e in evs]
        dtypes = dict(cls._NUMERIC + cls._OPTIONAL)
        arrays = {name: np.asarray(v, dtype=dtypes[name]) for name, v in cols.items()}
        arrays["est_ns"] = np.asarray([np.nan if e.est_ns is None else e.est_ns for e in evs], dtype=np.float64)
        table = [text for text, i in sorted(strings.items(), key=lambda kv: kv[1]) if i >= 0]
        return cls(n=len(evs), arrays=arrays, strings=table, kinds=tuple(kinds), engines=tuple(engines),
                   directions=tuple(directions), stack_frames=[st for st, _ in stacks],
                   stack_sources=[src for _, src in stacks])

    def __len__(self) -> int:
        return self.n

    def column(self, name: str) -> Any:
        """Numeric column ``name`` as a numpy array; an absent optional column (:data:`ASYNC_COLUMNS`)
        is an array of its default value."""
        import numpy as np

        arr = self.arrays.get(name)
        if arr is None:
            if name not in ASYNC_COLUMNS:
                raise KeyError(f"no column {name!r} in the recorded columns")
            arr = np.full(self.n, ASYNC_COLUMNS[name], dtype=np.int64)
        return arr

    def rows_of_kind(self, *kinds: str) -> Any:
        """Row indices (numpy) of the events whose kind is one of ``kinds``."""
        import numpy as np

        codes = [i for i, k in enumerate(self.kinds) if k in kinds]
        return np.flatnonzero(np.isin(self.arrays["kind"], codes))

    def events_at(self, rows: Any) -> list[KernelEvent]:
        """The :class:`KernelEvent` objects of the given rows only (e.g. the syncs of a long trace)."""
        import numpy as np

        rows = np.asarray(rows, dtype=np.int64)
        sub = RecordedColumns(n=len(rows), arrays={k: v[rows] for k, v in self.arrays.items()},
                              strings=self.strings, kinds=self.kinds, engines=self.engines,
                              directions=self.directions, stack_frames=self.stack_frames,
                              stack_sources=self.stack_sources)
        return sub.events()

    def kind_counts(self) -> dict[str, int]:
        """Events per kind."""
        import numpy as np

        counts = np.bincount(self.arrays["kind"], minlength=len(self.kinds)).tolist() if self.n else []
        return {k: int(c) for k, c in zip(self.kinds, counts) if c}

    def strings_of(self, ids: Any) -> list[str]:
        """The strings of ``ids`` into :attr:`strings` (-1: '')."""
        return self._strings_of(ids)

    def sources_of(self, rows: Any) -> list[str | None]:
        """``KernelEvent.location`` of the given rows, without building events."""
        n_stacks = len(self.stack_frames)
        sources = list(self.stack_sources)
        out: list[str | None] = []
        for i in self.arrays["stack"][rows].tolist():
            if not 0 <= i < n_stacks:
                out.append(None)
                continue
            src = sources[i] if i < len(sources) else None
            frames = self.stack_frames[i]
            out.append(src if src else (str(frames[-1]) if frames else None))
        return out

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
            *(self.column(c).tolist() if c in a else [ASYNC_COLUMNS[c]] * n for c in ASYNC_COLUMNS),
        )
        gc_was = gc.isenabled()
        gc.disable()  # millions of new objects, none cyclic: collecting while building them is wasted work
        try:
            return [_trusted_event(row) for row in zip(*columns)]
        finally:
            if gc_was:
                gc.enable()


def _optional_array(value: Any, n: int, name: str, dtype: str) -> Any:
    """An optional recorder column as an int array of length ``n``: packed bytes of any int width, or a
    sequence/array of ints."""
    import numpy as np

    if isinstance(value, (bytes, bytearray, memoryview)):
        size = len(value)
        if n == 0:
            return np.zeros(0, dtype=dtype)
        width = size // n if size % n == 0 else 0
        if width not in (1, 2, 4, 8):
            raise ValueError(f"recorder column {name!r}: {size} bytes for {n} events is not a packed int column")
        return np.frombuffer(value, dtype=f"<i{width}" if width > 1 else "i1", count=n)
    arr = np.asarray(value, dtype=np.int64)
    if arr.shape != (n,):
        raise ValueError(f"recorder column {name!r} has {arr.size} values for {n} events")
    return arr


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
    stream, h_start, h_end, corr = col("stream"), col("host_start_ns"), col("host_end_ns"), col("correlation")
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
                stream=int(stream[i]) if stream is not None else 0,
                host_start_ns=int(h_start[i]) if h_start is not None else 0,
                host_end_ns=int(h_end[i]) if h_end is not None else 0,
                correlation=int(corr[i]) if corr is not None else 0,
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
