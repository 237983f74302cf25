"""``torch.neuron`` memory API: the names and semantics of ``torch.cuda.memory``.

Every function reads the C++ caching allocator through the ``_C`` extension returned by
:func:`torchneuron_lab.device._backend.lib` (contract: ``notes/api.md``). Reading statistics never
initialises a device: an untouched device reports zeros.

The snapshot returned by :func:`_snapshot` has the documented layout of
``torch.cuda.memory._snapshot()`` so that ``torch.cuda._memory_viz`` (``segment_plot``,
``trace_plot``, ``segsum``, ``trace``, ``segments``, ``memory``, ``compare``) accepts it unchanged.
"""

from __future__ import annotations

import collections
import inspect
import pickle
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Literal, TypedDict

import torch

from ._backend import lib as _lib

__all__ = [
    "caching_allocator_alloc",
    "caching_allocator_delete",
    "empty_cache",
    "get_allocator_backend",
    "get_per_process_memory_fraction",
    "host_memory_stats",
    "host_memory_stats_as_nested_dict",
    "max_memory_allocated",
    "max_memory_cached",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_cached",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_summary",
    "reset_accumulated_host_memory_stats",
    "reset_accumulated_memory_stats",
    "reset_max_memory_allocated",
    "reset_max_memory_cached",
    "reset_peak_host_memory_stats",
    "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
]

DEVICE_TYPE = "neuron"

Device = torch.device | str | int | None

# Highest pickle protocol the MemoryViz.js unpickler (behind _memory_viz.*_plot) understands.
SNAPSHOT_PICKLE_PROTOCOL = 4


class Frame(TypedDict):
    """One stack frame; frame lists are innermost call first."""

    filename: str
    line: int
    name: str


class Block(TypedDict):
    """A piece of a segment: handed to a tensor, waiting to be freed, or cached."""

    address: int
    size: int
    requested_size: int
    state: Literal["active_allocated", "active_pending_free", "inactive"]
    frames: list[Frame]


class Segment(TypedDict):
    """Memory the allocator got from the device runtime; its blocks tile it in address order."""

    device: int
    address: int
    total_size: int
    allocated_size: int
    active_size: int
    requested_size: int
    stream: int
    segment_type: Literal["small", "large"]
    segment_pool_id: tuple[int, int]
    is_expandable: bool
    frames: list[Frame]
    blocks: list[Block]


class TraceEntry(TypedDict, total=False):
    """One allocator action recorded while :func:`_record_memory_history` is on.

    ``oom`` entries carry ``device_free`` instead of ``addr``.
    """

    action: Literal[
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "oom",
        "snapshot",
    ]
    addr: int
    device_free: int
    size: int
    stream: int
    frames: list[Frame]
    time_us: int


class Snapshot(TypedDict, total=False):
    """What :func:`_snapshot` returns; ``device_traces[i]`` holds device ``i``'s history."""

    segments: list[Segment]
    device_traces: list[list[TraceEntry]]
    allocator_settings: dict[str, Any]


# --------------------------------------------------------------------------- devices


def _parse_device_string(text: str, original: object) -> int | None:
    """``'neuron'`` / ``'neuron:1'`` to an index (``None`` when absent), parsed by ``torch.device`` as
    ``torch.cuda``'s functions do: a string torch.device rejects (``'neuron:01'``, ``' neuron:1'``) raises
    its ``RuntimeError: Invalid device string``."""
    dev = torch.device(text)
    if dev.type != DEVICE_TYPE:
        raise ValueError(
            f"Expected a {DEVICE_TYPE} device, got {original!r} (device type {dev.type!r}); "
            f"use None, an int, '{DEVICE_TYPE}', '{DEVICE_TYPE}:<index>' or torch.device('{DEVICE_TYPE}', i)"
        )
    return dev.index


class InvalidDeviceIndexError(ValueError, RuntimeError):
    """A neuron device index out of range: a ``RuntimeError`` as CUDA raises, and a ``ValueError`` (a bad value)."""


def _device_index(device: Device = None) -> int:
    """Resolve ``device`` to a validated device index.

    Accepts ``None`` (the current device), an ``int``, ``'neuron'``, ``'neuron:1'``, a
    ``torch.device`` of type ``neuron`` or a ``torch.neuron.device`` context object (as
    ``torch.cuda``'s functions accept a ``torch.cuda.device``). A device without an index means the
    current device.

    Raises:
        ValueError: another device type, an index out of range (as ``InvalidDeviceIndexError``, also a
            ``RuntimeError`` like CUDA's invalid-device error), or an object that is not a device
            (CUDA's ``_get_device_index`` raises ``ValueError`` too).
        TypeError: a bool.
        RuntimeError: a string ``torch.device`` rejects (``Invalid device string``).
    """
    index: int | None
    if device is None:
        index = None
    elif isinstance(device, bool):
        raise TypeError(f"Expected a {DEVICE_TYPE} device or index, got the bool {device!r}")
    elif isinstance(device, int):
        index = device
    elif isinstance(device, str):
        index = _parse_device_string(device, device)
    elif isinstance(device, torch.device):
        if device.type != DEVICE_TYPE:
            raise ValueError(f"Expected a {DEVICE_TYPE} device, got {device!r} (device type {device.type!r})")
        index = device.index
    elif type(device).__module__.startswith("torchneuron_lab") and isinstance(getattr(device, "idx", None), int):
        index = None if device.idx < 0 else device.idx  # torch.neuron.device(...) / device_of(...): its index
    else:  # a ValueError, as torch.cuda's _get_device_index raises for a non-device
        raise ValueError(
            f"Expected a {DEVICE_TYPE} device (None, int, str or torch.device), "
            f"got {device!r} of type {type(device).__name__}"
        )
    C = _lib()
    if index is None:
        return int(C.current_device())
    count = int(C.device_count())
    if not 0 <= index < count:
        shown = device if isinstance(device, (str, torch.device)) else f"{DEVICE_TYPE}:{index}"
        if count == 0:
            allowed = f"no {DEVICE_TYPE} devices are available"
        else:
            allowed = f"valid indices are 0..{count - 1} ({count} {DEVICE_TYPE} device{'s' * (count != 1)})"
        raise InvalidDeviceIndexError(
            f"Invalid device {str(shown)!r}: index {index} is out of range; {allowed}"
        )
    return index


# --------------------------------------------------------------------------- statistics


def _flatten(nested: dict[Any, Any]) -> list[tuple[str, Any]]:
    """Flatten nested stats into ``("a.b.c", value)`` pairs; tuple keys join with ``_``."""
    pairs: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = [("", nested)]
    while stack:
        prefix, node = stack.pop()
        if not isinstance(node, dict):
            pairs.append((prefix, node))
            continue
        for key, value in node.items():
            name = "_".join(str(part) for part in key) if isinstance(key, tuple) else str(key)
            stack.append((f"{prefix}.{name}" if prefix else name, value))
    return pairs


def memory_stats_as_nested_dict(device: Device = None) -> dict[str, Any]:
    """Return the caching allocator statistics of ``device`` as the nested dict built in C++.

    Layout: ``{"allocated_bytes": {"all": {"current", "peak", "allocated", "freed"}, "small_pool":
    ..., "large_pool": ...}, ..., "num_ooms": int, ...}``; see :func:`memory_stats`. Empty in a
    process forked after the device was used (its allocator is the parent's), as ``torch.cuda``'s.
    """
    if _lib().in_bad_fork():
        return {}
    return dict(_lib().memory_stats(_device_index(device)))


def memory_stats(device: Device = None) -> dict[str, Any]:
    """Return the allocator statistics of ``device`` as a flat, key-sorted dict.

    Keys are those of ``torch.cuda.memory_stats``:

    - ``"{allocation,segment,active,inactive_split}.{all,large_pool,small_pool}.{current,peak,allocated,freed}"``
      (counts) and the same for ``allocated_bytes``, ``reserved_bytes``, ``active_bytes``,
      ``inactive_split_bytes`` and ``requested_bytes`` (bytes);
    - ``num_alloc_retries``, ``num_ooms``, ``num_sync_all_streams``, ``num_device_alloc``,
      ``num_device_free``, ``max_split_size``;
    - ``"{oversize_allocations,oversize_segments}.{current,peak,allocated,freed}"``.

    ``current`` is the value now, ``peak`` its maximum since the last
    :func:`reset_peak_memory_stats`, ``allocated``/``freed`` the totals added/removed since the
    last :func:`reset_accumulated_memory_stats`.

    Args:
        device: ``None`` (current device), an index, ``'neuron:i'`` or ``torch.device``.
    """
    pairs = _flatten(memory_stats_as_nested_dict(device))
    pairs.sort()
    return collections.OrderedDict(pairs)


def _stat(device: Device, group: str, field: str) -> int:
    """One counter read straight from the nested stats (no flattening: these are called in loops)."""
    nested = memory_stats_as_nested_dict(device)
    return int(nested.get(group, {}).get("all", {}).get(field, 0))


def memory_allocated(device: Device = None) -> int:
    """Return the bytes currently occupied by tensors on ``device``."""
    return _stat(device, "allocated_bytes", "current")


def max_memory_allocated(device: Device = None) -> int:
    """Return the peak bytes occupied by tensors on ``device`` since the last peak reset."""
    return _stat(device, "allocated_bytes", "peak")


def memory_reserved(device: Device = None) -> int:
    """Return the bytes the caching allocator currently holds on ``device`` (used or cached)."""
    return _stat(device, "reserved_bytes", "current")


def max_memory_reserved(device: Device = None) -> int:
    """Return the peak bytes held by the caching allocator on ``device`` since the last peak reset."""
    return _stat(device, "reserved_bytes", "peak")


def reset_peak_memory_stats(device: Device = None) -> None:
    """Reset every ``peak`` statistic of ``device`` to its ``current`` value."""
    _lib().reset_peak_stats(_device_index(device))


def reset_accumulated_memory_stats(device: Device = None) -> None:
    """Reset the ``allocated``/``freed`` totals and ``num_alloc_retries``/``num_ooms`` of ``device``."""
    _lib().reset_accumulated_stats(_device_index(device))


def reset_max_memory_allocated(device: Device = None) -> None:
    """Reset the peak tracked by :func:`max_memory_allocated`.

    Like ``torch.cuda``, this calls :func:`reset_peak_memory_stats` and so resets *all* peaks.
    """
    warnings.warn(
        "torch.neuron.reset_max_memory_allocated now calls torch.neuron.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.",
        FutureWarning,
        stacklevel=2,
    )
    reset_peak_memory_stats(device)


def empty_cache() -> None:
    """Return every unoccupied cached segment, on all devices, to the device runtime.

    Memory held by live tensors is untouched; :func:`memory_reserved` drops, while
    :func:`memory_allocated` does not change. Does nothing in a process forked after the device was
    used, as ``torch.cuda``'s.
    """
    if _lib().in_bad_fork():
        return
    _lib().empty_cache()


def memory_cached(device: Device = None) -> int:
    """Deprecated; see :func:`memory_reserved` (as ``torch.cuda.memory_cached``)."""
    warnings.warn(
        "torch.neuron.memory_cached has been renamed to torch.neuron.memory_reserved", FutureWarning, stacklevel=2
    )
    return memory_reserved(device)


def max_memory_cached(device: Device = None) -> int:
    """Deprecated; see :func:`max_memory_reserved` (as ``torch.cuda.max_memory_cached``)."""
    warnings.warn(
        "torch.neuron.max_memory_cached has been renamed to torch.neuron.max_memory_reserved",
        FutureWarning,
        stacklevel=2,
    )
    return max_memory_reserved(device)


def reset_max_memory_cached(device: Device = None) -> None:
    """Reset the peak tracked by :func:`max_memory_cached`; like ``torch.cuda``, resets *all* peaks."""
    warnings.warn(
        "torch.neuron.reset_max_memory_cached now calls torch.neuron.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.",
        FutureWarning,
        stacklevel=2,
    )
    reset_peak_memory_stats(device)


def set_per_process_memory_fraction(fraction: float, device: Device = None) -> None:
    """Limit the memory this process's caching allocator may reserve on ``device`` to ``fraction`` of
    its capacity (as ``torch.cuda.set_per_process_memory_fraction``): an allocation that would reserve
    more raises ``torch.OutOfMemoryError``. Memory already reserved is kept. Initialises the device.

    Raises:
        TypeError: ``fraction`` is not a float. ValueError: it is outside ``[0, 1]``.
    """
    index = _device_index(device)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if not 0 <= fraction <= 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _lib().set_memory_fraction(fraction, index)


def get_per_process_memory_fraction(device: Device = None) -> float:
    """The fraction set by :func:`set_per_process_memory_fraction` for ``device`` (1.0 by default)."""
    index = _device_index(device)
    return float(_lib().memory_fraction(index))


def caching_allocator_alloc(size: int, device: Device = None, stream: Any = None) -> int:
    """Allocate ``size`` bytes from the caching allocator and return the address (as
    ``torch.cuda.caching_allocator_alloc``): the memory is ordered on ``stream`` (default: the current
    stream of ``device``) and held until :func:`caching_allocator_delete`.

    Raises:
        TypeError: ``stream`` is not a ``torch.neuron.Stream``, ``torch.Stream`` of neuron, or an int.
    """
    index = _device_index(device)
    if stream is None:
        stream_id = int(_lib().current_stream(index))
    elif isinstance(stream, torch.Stream):
        if stream.device.type != DEVICE_TYPE:
            raise TypeError(f"Invalid type for stream argument, must be a {DEVICE_TYPE} stream, got {stream!r}")
        if stream.device_index != index:
            raise ValueError(f"stream {stream!r} is on {DEVICE_TYPE}:{stream.device_index}, not {DEVICE_TYPE}:{index}")
        stream_id = int(stream.stream_id)
    elif isinstance(stream, int) and not isinstance(stream, bool):
        stream_id = stream
    else:
        raise TypeError(
            f"Invalid type for stream argument, must be `torch.neuron.Stream` or `int` representing a pointer "
            f"to a existing stream, got {type(stream).__name__}"
        )
    return int(_lib().raw_alloc(size, index, stream_id))


def caching_allocator_delete(mem_ptr: int) -> None:
    """Free memory from :func:`caching_allocator_alloc` (as ``torch.cuda.caching_allocator_delete``);
    stream-ordered like a tensor's free. The null pointer (what ``caching_allocator_alloc(0)`` returns) is a
    no-op, as on CUDA."""
    if mem_ptr == 0:
        return
    _lib().raw_delete(mem_ptr)


def get_allocator_backend() -> str:
    """The allocator backend: ``"native"`` (the lab's caching allocator), as ``torch.cuda``'s default."""
    return "native"


def host_memory_stats_as_nested_dict() -> dict[str, Any]:
    """Pinned host memory statistics (``tensor.pin_memory()``), nested, as
    ``torch.cuda.host_memory_stats_as_nested_dict``. Pinned memory is not cached: it returns to the
    system when freed, so ``allocations`` equal ``active_requests``."""
    return dict(_lib().host_memory_stats())


def host_memory_stats() -> dict[str, Any]:
    """Pinned host memory statistics, flat and key-sorted, as ``torch.cuda.host_memory_stats``:
    ``"{active_requests,active_bytes,allocations,allocated_bytes}.{current,peak,allocated,freed}"``,
    ``"{host_alloc_time,host_free_time}.{total,max,min,count,avg}"`` (not measured: 0),
    ``num_host_alloc`` and ``num_host_free``."""
    pairs = _flatten(host_memory_stats_as_nested_dict())
    pairs.sort()
    return collections.OrderedDict(pairs)


def reset_accumulated_host_memory_stats() -> None:
    """Reset the ``allocated``/``freed`` totals of :func:`host_memory_stats`."""
    _lib().reset_host_accumulated_stats()


def reset_peak_host_memory_stats() -> None:
    """Reset the ``peak`` values of :func:`host_memory_stats` to their ``current`` values."""
    _lib().reset_host_peak_stats()


def mem_get_info(device: Device = None) -> tuple[int, int]:
    """Return ``(free, total)`` device memory in bytes, as the device runtime reports it."""
    free, total = _lib().mem_get_info(_device_index(device))
    return int(free), int(total)


# --------------------------------------------------------------------------- summary

_SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_COUNT_UNITS = ("", "K", "M", "G")

# (stat key, row label, kind) for the 3-pool statistics, in torch.cuda.memory_summary's order.
_POOL_METRICS: tuple[tuple[str, str, str], ...] = (
    ("allocated_bytes", "Allocated memory", "bytes"),
    ("active_bytes", "Active memory", "bytes"),
    ("requested_bytes", "Requested memory", "bytes"),
    ("reserved_bytes", "Reserved memory", "bytes"),
    ("inactive_split_bytes", "Non-releasable memory", "bytes"),
    ("allocation", "Allocations", "count"),
    ("active", "Active allocs", "count"),
    ("segment", "Reserved segments", "count"),
    ("inactive_split", "Non-releasable allocs", "count"),
)
_OVERSIZE_METRICS: tuple[tuple[str, str], ...] = (
    ("oversize_allocations", "Oversize allocations"),
    ("oversize_segments", "Oversize segments"),
)
_COLUMNS = ("current", "peak", "allocated", "freed")
_WIDTH = 75  # characters between the outer '|'


def _scaled(value: int, reference: int, units: tuple[str, ...], base: int, switch: int) -> str:
    """Write ``value`` in the unit chosen for ``reference`` so that rows of one metric line up.

    The unit grows while ``reference`` would need ``switch * base`` or more of the current one.
    """
    step = 0
    while step + 1 < len(units) and reference >= switch * base ** (step + 1):
        step += 1
    return f"{value // base**step} {units[step]}"


def _cell(value: int, reference: int, kind: str) -> str:
    if kind == "bytes":
        return _scaled(value, reference, _SIZE_UNITS, 1024, 768)
    return _scaled(value, reference, _COUNT_UNITS, 1000, 750)


def _row(label: str, cells: tuple[str, ...]) -> str:
    return f" {label:<22}" + "".join(f"| {c:>10} " for c in cells)


def memory_summary(device: Device = None, abbreviated: bool = False) -> str:
    """Return a human-readable table of the allocator statistics of ``device``.

    Same sections as ``torch.cuda.memory_summary``: a header with the device index, the OOM and
    allocation-retry counters, one block per statistic (all pools, then large and small pool
    unless ``abbreviated``) with current, peak, total allocated and total freed columns, and the
    oversize allocation/segment counters. Each metric's rows use the unit picked for its
    ``all`` row so that the columns compare at a glance.
    """
    index = _device_index(device)
    stats = memory_stats(index)

    def stat(key: str) -> int:
        return int(stats.get(key, 0))

    thick, thin = "=" * _WIDTH, "-" * _WIDTH
    lines = [
        thick,
        f"PyTorch {DEVICE_TYPE} memory summary, device ID {index}".center(_WIDTH),
        thin,
        (
            f"{DEVICE_TYPE.capitalize()} OOMs: {stat('num_ooms')}".center(_WIDTH // 2)
            + "|"
            + f"device alloc retries: {stat('num_alloc_retries')}".center(_WIDTH - _WIDTH // 2 - 1)
        ),
        thick,
        _row("       Metric", ("Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed")),
    ]
    pools = (
        [("all", None)] if abbreviated else [("all", None), ("large_pool", "large"), ("small_pool", "small")]
    )
    for key, label, kind in _POOL_METRICS:
        lines.append(thin)
        refs = [stat(f"{key}.all.{col}") for col in _COLUMNS]
        for pool, pool_name in pools:
            values = [stat(f"{key}.{pool}.{col}") for col in _COLUMNS]
            row_label = label if pool_name is None else f"      from {pool_name} pool"
            lines.append(_row(row_label, tuple(_cell(v, r, kind) for v, r in zip(values, refs))))
    for key, label in _OVERSIZE_METRICS:
        lines.append(thin)
        values = [stat(f"{key}.{col}") for col in _COLUMNS]
        lines.append(_row(label, tuple(_cell(v, v, "count") for v in values)))
    lines.append(thick)
    return "".join(f"|{line:<{_WIDTH}}|\n" for line in lines)


# --------------------------------------------------------------------------- snapshots and history

_HISTORY_ENABLED = ("state", "all")
_HISTORY_CONTEXT = ("state", "alloc", "all")
_HISTORY_STACKS = ("python", "all")
# the arguments of the last ``_record_memory_history`` call, so a caller can restore the previous state
_HISTORY_STATE: dict[str, Any] = {"enabled": None, "context": None, "max_entries": sys.maxsize}


def _history_state() -> dict[str, Any]:
    """``{"enabled", "context", "max_entries"}`` of the allocator history recording now (enabled None:
    off); pass them back to :func:`_record_memory_history` to restore it."""
    return dict(_HISTORY_STATE)


def _record_memory_history_impl(
    enabled: Literal["state", "all"] | None = "all",
    context: Literal["state", "alloc", "all"] | None = "all",
    stacks: Literal["python", "all"] = "all",
    max_entries: int = sys.maxsize,
    device: Device = None,
    clear_history: bool = False,
    compile_context: bool = False,
    global_record_annotations: bool = False,
    skip_actions: list[str] | None = None,
) -> None:
    """Start or stop recording allocator history for :func:`_snapshot`.

    Same signature as ``torch.cuda.memory._record_memory_history``.

    Args:
        enabled: ``None`` stops recording; ``"state"`` keeps stacks of live allocations only;
            ``"all"`` also keeps the last ``max_entries`` alloc/free events
            (``snapshot["device_traces"]``).
        context: ``None`` records no stacks; any of ``"state"``, ``"alloc"``, ``"all"`` records
            the Python stack of each allocation.
        stacks: ``"python"`` or ``"all"``; only Python frames are recorded either way.
        max_entries: size of the event ring buffer (used with ``enabled="all"``).
        device: validated like every other ``device`` argument; recording covers all devices,
            as in ``torch.cuda``.
        clear_history, compile_context, global_record_annotations, skip_actions: accepted for
            signature compatibility; only their default values are supported.
    """
    if isinstance(enabled, bool):
        raise TypeError("a bool `enabled` is the older form: call _record_memory_history(enabled, ...)")
    if enabled is not None and enabled not in _HISTORY_ENABLED:
        raise ValueError(f"enabled must be None, 'state' or 'all', got {enabled!r}")
    if context is not None and context not in _HISTORY_CONTEXT:
        raise ValueError(f"context must be None, 'state', 'alloc' or 'all', got {context!r}")
    if stacks not in _HISTORY_STACKS:
        raise ValueError(f"stacks must be 'python' or 'all', got {stacks!r}")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
        raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
    unsupported = {
        "clear_history": clear_history,
        "compile_context": compile_context,
        "global_record_annotations": global_record_annotations,
        "skip_actions": bool(skip_actions),
    }
    for name, value in unsupported.items():
        if value:
            raise NotImplementedError(
                f"_record_memory_history({name}=...) is not supported by the {DEVICE_TYPE} allocator; "
                "leave it at its default"
            )
    if device is not None:
        _device_index(device)
    entries = min(max_entries, 2**63 - 1) if enabled == "all" else 1
    _lib().record_memory_history(enabled is not None, context is not None, entries)
    _HISTORY_STATE.update(
        enabled=enabled, context=None if enabled is None else context, max_entries=max_entries
    )


def _record_memory_history_legacy(
    enabled: bool,
    record_context: bool = True,
    trace_alloc_max_entries: int = 1,
    trace_alloc_record_context: bool = False,
    device: Device = None,
    record_context_cpp: bool = False,
    clear_history: bool = False,
    compile_context: bool = False,
    global_record_annotations: bool = False,
    skip_actions: list[str] | None = None,
) -> None:
    """``torch.cuda``'s older form (``enabled`` a bool): stacks of live allocations with
    ``record_context``, and an alloc/free trace of ``trace_alloc_max_entries`` entries when that is
    more than 1 (the default 1: state only)."""
    if not enabled:
        _record_memory_history_impl(None, device=device, clear_history=clear_history, compile_context=compile_context,
                                    global_record_annotations=global_record_annotations, skip_actions=skip_actions)
        return
    _record_memory_history_impl(
        "all" if trace_alloc_max_entries > 1 else "state",
        "all" if (record_context or trace_alloc_record_context) else None,
        "all" if record_context_cpp else "python",
        max(1, trace_alloc_max_entries) if isinstance(trace_alloc_max_entries, int) else trace_alloc_max_entries,
        device,
        clear_history,
        compile_context,
        global_record_annotations,
        skip_actions,
    )


def _record_memory_history(enabled: Literal["state", "all"] | bool | None = "all", *args: Any, **kwargs: Any) -> None:
    """Start or stop recording allocator history for :func:`_snapshot`; the signature of
    ``torch.cuda.memory._record_memory_history``: a bool ``enabled`` takes the older arguments
    (:func:`_record_memory_history_legacy`), otherwise those of :func:`_record_memory_history_impl`."""
    if isinstance(enabled, bool):
        _record_memory_history_legacy(enabled, *args, **kwargs)
    else:
        _record_memory_history_impl(enabled, *args, **kwargs)


_record_memory_history.__signature__ = inspect.signature(_record_memory_history_impl)  # type: ignore[attr-defined]


def _snapshot(device: Device = None, augment_with_fx_traces: bool = False) -> Snapshot:
    """Return the allocator state and recorded history of all devices.

    The dict has the layout of ``torch.cuda.memory._snapshot()`` (see the :class:`Snapshot`,
    :class:`Segment`, :class:`Block`, :class:`TraceEntry` and :class:`Frame` types) and can be
    passed to ``torch.cuda._memory_viz``. As in ``torch.cuda``, ``device`` does not filter: the
    snapshot always covers every device; it is only validated.
    """
    if device is not None:
        _device_index(device)
    snapshot: Snapshot = _lib().snapshot()
    if augment_with_fx_traces:  # torch's own helper, as torch.cuda's _snapshot uses
        from torch._utils import _augment_memory_snapshot_stack_traces

        snapshot = _augment_memory_snapshot_stack_traces(snapshot)  # type: ignore[assignment,arg-type]
    return snapshot


def memory_snapshot(
    mempool_id: tuple[int, int] | None = None, include_traces: bool = True, *, device: Device = None
) -> list[Segment]:
    """Return the allocator's segments (``_snapshot()["segments"]``), with the signature of
    ``torch.cuda.memory_snapshot(mempool_id=None, include_traces=True)``.

    Every device's segments by default; ``device=`` keeps only that device's (so does a device given in
    the first place, this function's older form: an int, str or torch.device is never a pool id). There
    are no private pools (``MemPool``): the default pool's id ``(0, 0)`` is ``None``, another raises
    ``NotImplementedError``. ``include_traces`` is accepted as CUDA's: it concerns the history
    (``device_traces``), which this list of segments does not hold.
    """
    if isinstance(mempool_id, (int, str, torch.device)) and not isinstance(mempool_id, bool):
        if device is not None:
            raise TypeError("memory_snapshot() got a device twice (first argument and device=)")
        mempool_id, device = None, mempool_id
    if mempool_id is not None:
        if not isinstance(mempool_id, tuple):
            raise TypeError(f"memory_snapshot(mempool_id=...) takes a memory pool id (a tuple), got {mempool_id!r}")
        if tuple(mempool_id) != (0, 0):
            raise NotImplementedError(f"the {DEVICE_TYPE} allocator has no private memory pools (MemPool)")
    index = None if device is None else _device_index(device)
    segments = _snapshot()["segments"]
    if index is not None:
        segments = [seg for seg in segments if seg["device"] == index]
    return segments


def _dump_snapshot(filename: str = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
    """Pickle :func:`_snapshot` to ``filename`` for https://pytorch.org/memory_viz.

    Written with pickle protocol 4, the newest the viewer's unpickler reads.
    """
    snapshot = _snapshot(augment_with_fx_traces=augment_with_fx_traces)
    with open(filename, "wb") as f:
        pickle.dump(snapshot, f, protocol=SNAPSHOT_PICKLE_PROTOCOL)


def _snapshot_problems(snapshot: Mapping[str, Any]) -> list[str]:
    """List the ways ``snapshot`` would break ``_memory_viz`` or the MemoryViz.js viewer.

    Checks value types, block tiling and states, that ``device_traces`` covers every device
    with segments, and replays each device's trace backwards from the final segments the way the
    viewer's "Allocator State History" does, requiring every live block to sit in a live
    segment. Returns an empty list for a consistent snapshot.
    """
    problems: list[str] = []
    segments = snapshot.get("segments", [])
    traces = snapshot.get("device_traces", [])
    states = ("active_allocated", "active_pending_free", "inactive")
    live_blocks: dict[int, dict[int, int]] = collections.defaultdict(dict)
    live_segments: dict[int, dict[int, int]] = collections.defaultdict(dict)
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        device = seg.get("device")
        if not isinstance(device, int) or isinstance(device, bool):
            problems.append(f"{where}: 'device' must be an int, got {device!r}")
            continue
        if device >= len(traces):
            problems.append(f"{where}: device {device} has no device_traces entry ({len(traces)} lists)")
        bad_keys = [key for key in ("address", "total_size", "stream") if not isinstance(seg.get(key), int)]
        if bad_keys:
            problems.append(f"{where}: {bad_keys} must be ints")
            continue
        offset = 0
        for j, block in enumerate(seg.get("blocks", [])):
            bwhere = f"{where}.blocks[{j}]"
            if block.get("state") not in states:
                problems.append(f"{bwhere}: state {block.get('state')!r} not in {states}")
            if "frames" not in block or "requested_size" not in block:
                problems.append(f"{bwhere}: needs both 'frames' and 'requested_size'")
            elif block["requested_size"] > block["size"] and block.get("state") == "active_allocated":
                problems.append(f"{bwhere}: requested_size {block['requested_size']} > size {block['size']}")
            if "address" in block and block["address"] != seg["address"] + offset:
                problems.append(f"{bwhere}: address {block['address']} != segment address + {offset}")
            if block.get("state") in states[:2]:
                live_blocks[device][seg["address"] + offset] = block["size"]
            offset += block["size"]
        if offset != seg["total_size"]:
            problems.append(f"{where}: blocks cover {offset} bytes, total_size is {seg['total_size']}")
        live_segments[device][seg["address"]] = seg["total_size"]

    for device, trace in enumerate(traces):
        problems.extend(_replay_problems(device, trace, live_blocks[device], live_segments[device]))
    return problems


def _replay_problems(
    device: int, trace: list[dict[str, Any]], blocks: dict[int, int], segs: dict[int, int]
) -> list[str]:
    """Undo ``trace`` from the final ``blocks``/``segs`` (address -> size); stop at the first fault.

    Expandable-segment ``segment_map``/``segment_unmap`` are treated like whole segments.
    """
    where = f"device_traces[{device}]"

    def stray_block() -> int | None:
        for addr, size in blocks.items():
            if not any(s <= addr and addr + size <= s + n for s, n in segs.items()):
                return addr
        return None

    stray = stray_block()
    if stray is not None:
        return [f"{where}: final state has block {stray:#x} outside every segment"]
    for k in range(len(trace) - 1, -1, -1):
        entry = trace[k]
        action = entry.get("action")
        if action == "oom":
            if not isinstance(entry.get("device_free"), int) or not isinstance(entry.get("size"), int):
                return [f"{where}[{k}]: oom entry needs int 'size' and 'device_free'"]
            continue
        if action == "snapshot":
            continue
        addr, size = entry.get("addr"), entry.get("size")
        if not isinstance(addr, int) or not isinstance(size, int):
            return [f"{where}[{k}]: {action!r} entry needs int 'addr' and 'size'"]
        if addr >= 2**53 or size >= 2**53:
            return [f"{where}[{k}]: addr/size of 2**53 or more lose precision in the JS viewer"]
        if action == "alloc":
            blocks.pop(addr, None)
        elif action == "free_completed":
            blocks[addr] = size
        elif action == "free_requested":
            if addr not in blocks:
                detail = "which is neither freed later in the trace nor live in the segments"
                return [f"{where}[{k}]: free_requested of {addr:#x}, {detail}"]
        elif action in ("segment_alloc", "segment_map"):
            if segs.pop(addr, None) is None:
                return [f"{where}[{k}]: {action} of {addr:#x}, which is not a segment at that point"]
        elif action in ("segment_free", "segment_unmap"):
            segs[addr] = size
        else:
            return [f"{where}[{k}]: unknown action {action!r}"]
        stray = stray_block()
        if stray is not None:
            return [f"{where}[{k}]: before this {action}, block {stray:#x} lies outside every segment"]
    return []
