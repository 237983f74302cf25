"""``torch.neuron``: the device module of the emulated NeuronCore, shaped like ``torch.cuda``."""

from __future__ import annotations

import atexit
import dataclasses
from typing import Any

import torch

from . import (
    amp,  # torch.neuron.amp, like torch.cuda.amp
    memory,  # torch.neuron.memory, like torch.cuda.memory
)
from ._backend import lib as _lib
from .memory import _device_index as _memory_device_index
from .memory import (
    _dump_snapshot,
    _record_memory_history,
    _snapshot,
    caching_allocator_alloc,
    caching_allocator_delete,
    empty_cache,
    get_allocator_backend,
    get_per_process_memory_fraction,
    host_memory_stats,
    host_memory_stats_as_nested_dict,
    max_memory_allocated,
    max_memory_cached,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_cached,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_stats_as_nested_dict,
    memory_summary,
    reset_accumulated_host_memory_stats,
    reset_accumulated_memory_stats,
    reset_max_memory_allocated,
    reset_max_memory_cached,
    reset_peak_host_memory_stats,
    reset_peak_memory_stats,
    set_per_process_memory_fraction,
)

__all__ = [
    "Event",
    "Stream",
    "StreamContext",
    "_dump_snapshot",
    "_record_memory_history",
    "_snapshot",
    "amp",
    "caching_allocator_alloc",
    "caching_allocator_delete",
    "current_device",
    "current_stream",
    "default_generators",
    "default_stream",
    "device",
    "device_count",
    "device_of",
    "empty_cache",
    "get_allocator_backend",
    "get_amp_supported_dtype",
    "get_device_capability",
    "get_device_name",
    "get_device_properties",
    "get_per_process_memory_fraction",
    "get_rng_state",
    "get_rng_state_all",
    "get_sync_debug_mode",
    "host_memory_stats",
    "host_memory_stats_as_nested_dict",
    "init",
    "initial_seed",
    "is_available",
    "is_bf16_supported",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_cached",
    "max_memory_reserved",
    "mem_get_info",
    "memory",
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
    "seed",
    "seed_all",
    "set_device",
    "set_per_process_memory_fraction",
    "set_rng_state",
    "set_rng_state_all",
    "set_stream",
    "set_sync_debug_mode",
    "stream",
    "synchronize",
]

_DeviceLike = torch.device | str | int | None


def _index(dev: _DeviceLike) -> int:
    return _memory_device_index(dev)


def is_available() -> bool:
    """Always True: the emulated device runs wherever the C++ core builds."""
    return True


def is_initialized() -> bool:
    """True once any neuron device has allocated memory; False in a process forked after that (as
    ``torch.cuda.is_initialized``: the device may not be used there)."""
    C = _lib()
    return bool(C.runtime_started()) and not C.in_bad_fork()


def _lazy_init() -> None:  # torch calls this on device modules
    C = _lib()
    if C.in_bad_fork():
        C.init()  # raises the C++ core's "Cannot re-initialize neuron in forked subprocess" error


def init() -> None:
    """Initialise every neuron device now (like ``torch.cuda.init``); otherwise the first use does.

    In a process forked after the parent used the device this raises ``RuntimeError: Cannot
    re-initialize neuron in forked subprocess...`` (use the ``spawn`` start method), as CUDA does.
    """
    _lib().init()


def _is_in_bad_fork() -> bool:
    """True in a child forked after the parent initialised the device (the child may not use it)."""
    return bool(_lib().in_bad_fork())


def get_device_capability(device: _DeviceLike = None) -> tuple[int, int]:
    """``(major, minor)`` of the emulated NeuronCore: its generation (``NeuronCore-v3`` on trn2 -> ``(3, 0)``)."""
    from . import profile

    _index(device)
    version = profile().neuron_core.rsplit("-v", 1)[-1]
    return (int(version), 0)


def device_count() -> int:
    return int(_lib().device_count())


def current_device() -> int:
    return int(_lib().current_device())


def _no_device(device: _DeviceLike) -> bool:
    """A negative index: ``torch.cuda.set_device`` and ``torch.cuda.device`` do nothing with one."""
    return isinstance(device, int) and not isinstance(device, bool) and device < 0


def set_device(device: _DeviceLike) -> None:
    """Set the current neuron device (like ``torch.cuda.set_device``: a negative index does nothing)."""
    if _no_device(device):
        return
    _lib().set_device(_index(device))


class device:
    """Context manager that changes the current neuron device (like ``torch.cuda.device``)."""

    def __init__(self, device: _DeviceLike) -> None:
        self.idx = -1 if device is None or _no_device(device) else _index(device)
        self.prev_idx = -1

    def __enter__(self) -> None:
        self.prev_idx = current_device()
        if self.idx >= 0 and self.idx != self.prev_idx:
            set_device(self.idx)

    def __exit__(self, *exc: object) -> bool:
        if self.idx >= 0 and self.prev_idx != self.idx:
            set_device(self.prev_idx)
        return False


class device_of(device):
    """Context manager that makes the tensor's device current (no-op for CPU tensors)."""

    def __init__(self, obj: torch.Tensor) -> None:
        super().__init__(obj.get_device() if obj.device.type == "neuron" else None)


_SYNC_DEBUG_MODES = {"default": 0, "warn": 1, "error": 2}


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """Warn or raise at the program's synchronizing operations, as ``torch.cuda.set_sync_debug_mode``.

    ``"default"`` or 0: nothing; ``"warn"`` or 1: a ``UserWarning`` "called a synchronizing neuron operation
    (...)" naming the operation, at the line that called it; ``"error"`` or 2: a ``RuntimeError`` with that
    message, raised before the operation waits or copies anything. Checked where CUDA checks: ``item()``
    (``tolist()``, printing a tensor), a copy between host and device with ``non_blocking=False`` (``.cpu()``,
    ``.to("neuron")``), an op whose result's shape or value depends on the data (``nonzero``, ``unique``,
    ``masked_select``, ...: the recorder's syncs), and ``Stream.synchronize()``. Not checked: the explicit
    ``torch.neuron.synchronize()`` and ``Event.synchronize()``, collectives, and the waits the emulator makes for
    itself (ops it runs on the host), none of which CUDA's mode checks either.
    """
    if isinstance(debug_mode, str):
        if debug_mode not in _SYNC_DEBUG_MODES:
            raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
        debug_mode = _SYNC_DEBUG_MODES[debug_mode]
    _lib().set_sync_debug_mode(int(debug_mode))


def get_sync_debug_mode() -> int:
    """The current mode of :func:`set_sync_debug_mode`: 0 (default), 1 (warn) or 2 (error)."""
    return int(_lib().sync_debug_mode())


def synchronize(device: _DeviceLike = None) -> None:
    """Wait until every kernel launched on every stream of the device has run (``torch.cuda.synchronize``).

    Recorded as a sync event with the time the host waited. An error a queued kernel raised is raised here.
    """
    _lib().synchronize(_index(device))


# ---- streams and events (torch.cuda's names; README "Asynchronous execution") ----

_PRIVATEUSE1: int | None = None


def _release_autograd_device_threads() -> None:
    """Let autograd's neuron device threads drop the graph tasks they still hold before the interpreter
    finalises. A backward that raised returns to the caller while the device thread is still finishing the
    failed graph; the graph task keeps the Python context torch stashes at every backward, and its last
    reference dropped during finalisation needs the GIL: the thread is torn down and the process aborts
    ("terminate called without an active exception", rc 134, 4 exits in 6). A tiny backward on each used
    device, launched from C++ without that stash, runs after everything queued before it on
    the device's thread, so the earlier tasks are released by the time it returns (C++ tensors only, twice:
    the second waits for the first's release, and neither holds a Python object)."""
    C = _lib()
    for d in _used_devices():  # a device never used: no device thread of autograd's ran its work
        C.release_autograd_device_thread(d)


def _used_devices() -> list[int]:
    """The devices that ran something in this process (none in a bad fork, or before the runtime started);
    asking starts no device."""
    C = _lib()
    if not C.runtime_started() or C.in_bad_fork():
        return []
    return [d for d in range(int(C.device_count())) if C.memory_stats(d)["segment"]["all"]["allocated"]]


def _drain_at_exit() -> None:  # kernels still queued finish before the interpreter goes away
    try:
        _release_autograd_device_threads()
    except Exception:  # noqa: BLE001, S110 - exit must not fail
        pass
    try:
        _lib().drain()
    except (Exception, KeyboardInterrupt):  # noqa: BLE001, S110 - exit must not fail (Ctrl-C: queued work dropped)
        pass
    _report_pending_errors_at_exit()


def _report_pending_errors_at_exit() -> None:
    """A kernel error that no synchronisation raised (the program ended before its next sync) is printed once
    on stderr, as CUDA prints a pending device error at teardown, instead of vanishing with the process."""
    import sys

    try:
        C = _lib()
        devices = _used_devices()
    except Exception:  # noqa: BLE001 - exit must not fail
        return
    for d in devices:
        try:
            C.synchronize(d)
        except Exception as e:  # noqa: BLE001 - reported, exit must not fail
            try:
                sys.stderr.write(f"torchneuron_lab: at exit, a kernel error no synchronisation had reported:\n{e}\n")
                sys.stderr.flush()
            except Exception:  # noqa: BLE001, S110 - stderr closed
                pass


atexit.register(_drain_at_exit)


def _device_type_code() -> int:
    global _PRIVATEUSE1
    if _PRIVATEUSE1 is None:
        _PRIVATEUSE1 = int(torch.Stream(device="neuron").device_type)
    return _PRIVATEUSE1


class Stream(torch.Stream):
    """A neuron stream: an in-order queue of kernels with its own device worker, as ``torch.cuda.Stream``.

    Kernels launched while a stream is current (``with torch.neuron.stream(s):``) run in launch order on it;
    kernels of different streams may overlap. ``priority`` is 0 (default) or -1 (high), as CUDA's range.
    """

    def __new__(cls, device: _DeviceLike = None, priority: int = 0, **kwargs: Any) -> Stream:  # noqa: PYI034
        if {"stream_id", "device_index", "device_type"} <= kwargs.keys():
            return super().__new__(cls, **kwargs)  # type: ignore[call-arg]
        return super().__new__(cls, device=torch.device("neuron", _index(device)), priority=int(priority))  # type: ignore[call-arg]

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # torch.Stream initialises in __new__
        pass

    @property
    def priority(self) -> int:
        return int(_lib().stream_priority(self.device_index, self.stream_id))

    def wait_event(self, event: torch.Event) -> None:
        """Kernels launched on this stream from now on wait for ``event`` (the host does not wait)."""
        event.wait(self)

    def wait_stream(self, stream: torch.Stream) -> None:
        """Kernels launched on this stream from now on wait for the work launched on ``stream`` so far."""
        self.wait_event(stream.record_event())

    def record_event(self, event: torch.Event | None = None) -> Event:  # type: ignore[override]
        """Record ``event`` (a new one if None) on this stream and return it."""
        ev = Event() if event is None else event
        ev.record(self)
        return ev  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"<torch.neuron.Stream device=neuron:{self.device_index} stream_id={self.stream_id} priority={self.priority}>"


class Event(torch.Event):
    """A marker in a neuron stream, as ``torch.cuda.Event``: ``record``, ``wait``, ``query``,
    ``synchronize``, ``elapsed_time`` (milliseconds between two timed events, measured on the device)."""

    def __new__(  # noqa: PYI034
        cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, external: bool = False,
        device: _DeviceLike = None,
    ) -> Event:
        if interprocess:
            raise RuntimeError("neuron events cannot be shared between processes (the emulated device has no IPC)")
        if external:  # CUDA's external events are recorded into CUDA graphs as nodes
            raise RuntimeError("neuron events cannot be external (the emulated device has no graph capture)")
        return super().__new__(  # type: ignore[call-arg]
            cls, device=torch.device("neuron", _index(device)), enable_timing=enable_timing, blocking=blocking
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: torch.Stream | None = None) -> None:
        super().record(current_stream() if stream is None else stream)

    def wait(self, stream: torch.Stream | None = None) -> None:
        super().wait(current_stream() if stream is None else stream)

    def elapsed_time(self, end_event: torch.Event) -> float:
        """Milliseconds between this event and ``end_event`` on the device (both recorded and complete)."""
        return float(_lib().event_elapsed_ms(self.event_id, end_event.event_id))

    def __repr__(self) -> str:
        return f"<torch.neuron.Event device={self.device} done={self.query()}>"


def current_stream(device: _DeviceLike = None) -> Stream:
    """This thread's current stream on the device (the default stream unless one was set)."""
    _lazy_init()  # in a child forked after the device was used: CUDA's bad-fork error, as torch.cuda's
    i = _index(device)
    return Stream(stream_id=int(_lib().current_stream(i)), device_index=i, device_type=_device_type_code())


def default_stream(device: _DeviceLike = None) -> Stream:
    """The device's default stream (stream id 0)."""
    _lazy_init()
    return Stream(stream_id=0, device_index=_index(device), device_type=_device_type_code())


def set_stream(stream: torch.Stream | None) -> None:
    """Make ``stream`` current on its device, and its device current, for this thread (None: no-op), as
    ``torch.cuda.set_stream`` and ``torch.accelerator.set_stream`` do."""
    if stream is None:
        return
    if stream.device_type != _device_type_code():
        raise ValueError(f"expected a neuron stream, got {stream!r}")
    _lib().set_stream(stream.device_index, stream.stream_id)
    if stream.device_index != current_device():
        set_device(stream.device_index)


class StreamContext:
    """Context manager that makes ``stream`` (and its device) current, restoring both on exit."""

    def __init__(self, stream: torch.Stream | None) -> None:
        self.stream = stream
        self._prev: list[tuple[int, int]] = []
        self._prev_device: int | None = None

    def __enter__(self) -> torch.Stream | None:
        s = self.stream
        if s is None:
            return None
        self._prev_device = current_device()
        self._prev.append((s.device_index, int(_lib().current_stream(s.device_index))))
        if s.device_index != self._prev_device:
            set_device(s.device_index)
        set_stream(s)
        return s

    def __exit__(self, *exc: object) -> None:
        if self.stream is None:
            return
        device_index, stream_id = self._prev.pop()
        _lib().set_stream(device_index, stream_id)
        if self._prev_device is not None and self._prev_device != device_index:
            set_device(self._prev_device)


def _sleep(ms: float, device: _DeviceLike = None) -> None:
    """Launch a kernel that keeps the current stream busy for ``ms`` milliseconds (``torch.cuda._sleep``'s
    counterpart, for tests and demos of overlap; it ends early when Ctrl-C drops the device's queue)."""
    _lib().sleep(_index(device), float(ms))


def stream(stream: torch.Stream | None) -> StreamContext:
    """``with torch.neuron.stream(s):`` kernels launched inside run on ``s``."""
    return StreamContext(stream)


def get_device_name(device: _DeviceLike = None) -> str:
    from . import profile

    _index(device)  # CUDA's goes through get_device_properties: a bad device raises
    return f"Emulated NeuronCore ({profile().name}, host CPU kernels)"


@dataclasses.dataclass(frozen=True)
class _NeuronDeviceProperties:
    """What ``torch.neuron.get_device_properties`` returns: the attributes of CUDA's ``_CudaDeviceProperties``
    that code reads (``name``, ``total_memory``, ``major``/``minor``, ``multi_processor_count``, ...) and the
    emulator's own. Item access (``props["total_memory"]``) still works, as the dict of earlier versions did."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int  # the intra-op threads a device kernel runs with (it runs on host CPU cores)
    is_integrated: bool
    L2_cache_size: int
    index: int
    profile: str
    emulated: bool
    num_devices: int

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def __repr__(self) -> str:
        return (f"_NeuronDeviceProperties(name={self.name!r}, major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1 << 20)}MB, multi_processor_count="
                f"{self.multi_processor_count}, profile={self.profile!r}, emulated=True)")


def get_device_properties(device: _DeviceLike = None) -> _NeuronDeviceProperties:
    from . import current_config, profile

    idx = _index(device)
    major, minor = get_device_capability(idx)
    return _NeuronDeviceProperties(
        name=get_device_name(idx), major=major, minor=minor, total_memory=int(_lib().capacity(idx)),
        multi_processor_count=torch.get_num_threads(), is_integrated=False, L2_cache_size=0, index=idx,
        profile=profile().name, emulated=True, num_devices=int(current_config()["num_devices"]),
    )


def get_amp_supported_dtype() -> list[torch.dtype]:
    """Dtypes ``torch.autocast("neuron", dtype=...)`` accepts."""
    return [torch.bfloat16, torch.float16, torch.float32]  # as CUDA: float32 is accepted (casts nothing)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# ---- random number generation (per-device generators, like torch.cuda.random) ----


_default_generators: tuple[torch.Generator, ...] | None = None


def _generators() -> tuple[torch.Generator, ...]:
    """One tuple of Generator objects, made at first use (``torch.cuda.default_generators`` is one tuple too:
    ``default_generators[0] is default_generators[0]``; a new tuple each time made new objects)."""
    global _default_generators
    if _default_generators is None:
        C = _lib()
        _default_generators = tuple(C.default_generator(i) for i in range(device_count()))
    return _default_generators


def _get_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (``torch.cuda._get_generator``): its ``graphsafe_get_state()``
    shares the generator's state, ``graphsafe_set_state`` and ``clone_state()`` work as CUDA's."""
    return _lib().default_generator(_index(device))


def __getattr__(name: str) -> Any:  # module attribute: built lazily, never initialises memory
    if name == "default_generators":
        return _generators()
    if name == "_initialized":
        # torch.cuda's flag, which torch code reads with getattr(device_module, "_initialized", False):
        # torch.utils.checkpoint saves and restores the device RNG state only when it is true (without it,
        # a checkpointed dropout's recomputed mask differed from the forward's: wrong gradients)
        return is_initialized()
    raise AttributeError(f"module 'torch.neuron' has no attribute {name!r}")


def _gen(device: _DeviceLike) -> torch.Generator:
    # Seeding or reading the state while random kernels are queued would reorder them: wait first.
    i = _index(device)
    _lib().synchronize(i)
    return _lib().default_generator(i)


def _seeding_skipped() -> bool:
    # In a child forked after the parent used the device, CUDA's seeding calls are queued for an
    # initialisation that can never happen there (torch.cuda._lazy_call): they do nothing and raise nothing
    # (a DataLoader worker's worker_init_fn seeds every device). Reading the state raises the bad-fork error.
    return bool(_lib().in_bad_fork())


def manual_seed(seed: int) -> None:
    """Seed the current neuron device's generator."""
    if not _seeding_skipped():
        _gen(None).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    if _seeding_skipped():
        return
    for i in range(device_count()):
        _gen(i).manual_seed(int(seed))


def seed() -> None:
    if not _seeding_skipped():
        _gen(None).seed()


def seed_all() -> None:
    """A random seed for neuron:0, and the same seed for every other device, as ``torch.cuda.seed_all``."""
    if _seeding_skipped():
        return
    first = _gen(0)
    first.seed()
    for i in range(1, device_count()):
        _gen(i).manual_seed(first.initial_seed())


def initial_seed() -> int:
    return int(_gen(None).initial_seed())


def get_rng_state(device: _DeviceLike = "neuron") -> torch.Tensor:
    _lazy_init()
    return _gen(None if device == "neuron" else device).get_state()


def set_rng_state(new_state: torch.Tensor, device: _DeviceLike = "neuron") -> None:
    _gen(None if device == "neuron" else device).set_state(
        new_state.clone(memory_format=torch.contiguous_format)
    )


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


# ---- multiprocessing: neuron memory belongs to the process that allocated it ----
#
# CUDA shares device tensors between processes through IPC handles; the emulated device's memory is host
# memory private to this process, so there is nothing another process could map. Sending a neuron tensor
# (or storage) to another process therefore fails at once, in the caller, naming the fix, instead of the
# ``_share_fd_: only available on CPU`` that torch's reduction raises in a queue's feeder thread (where the
# caller never sees it and the receiver waits forever).

_SHARING_ERROR = (
    "neuron tensors cannot be sent to another process: the emulated NeuronCore's memory belongs to the "
    "process that allocated it (there is no inter-process handle like CUDA IPC). Move the tensor to the "
    "CPU first (tensor.cpu()) and back to neuron in the receiving process."
)


def _is_neuron(obj: object) -> bool:
    if isinstance(obj, torch.TypedStorage):  # its .device warns "TypedStorage is deprecated" (every worker did)
        obj = obj._untyped_storage
    device = getattr(obj, "device", None)
    return isinstance(device, torch.device) and device.type == "neuron"


def _guard_reducer(original: Any) -> Any:
    def reduce(obj: Any) -> Any:
        if _is_neuron(obj):
            raise RuntimeError(_SHARING_ERROR)
        return original(obj)

    reduce._tnl_guard = True  # type: ignore[attr-defined]
    return reduce


class _NullSink:
    def write(self, data: bytes) -> int:
        return len(data)


def _contains_neuron_tensor(obj: object) -> bool:
    """Walk ``obj`` as pickle would (tensors and storages are not serialised, only inspected).

    Objects multiprocessing's own pickler reduces (sockets, connections, ``ForkingPickler.register``'s types)
    are leaves of the walk: a plain pickler refuses them, which ended the walk before a neuron tensor after
    them was seen (the error then came from the queue's feeder thread, and the receiver waited).
    """
    import functools
    import pickle
    import types
    from multiprocessing.reduction import ForkingPickler

    found = False
    # (bound methods and partials are among those types, but a plain pickler walks them: what they hold counts)
    walkable = (types.MethodType, types.MethodDescriptorType, types.WrapperDescriptorType, functools.partial)
    by_multiprocessing = tuple(t for t in getattr(ForkingPickler, "_extra_reducers", {})
                               if isinstance(t, type) and not issubclass(t, walkable))

    class _Probe(pickle.Pickler):
        def reducer_override(self, o: Any) -> Any:
            nonlocal found
            if isinstance(o, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
                if _is_neuron(o):
                    found = True
                    raise RuntimeError(_SHARING_ERROR)
                return (int, ())
            if by_multiprocessing and isinstance(o, by_multiprocessing):
                return (int, ())
            return NotImplemented

    try:
        _Probe(_NullSink(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except RuntimeError:
        return found
    except Exception:  # noqa: BLE001  (objects this probe cannot walk are left to the real pickler)
        return found
    return found


def _guard_queue_put(original: Any) -> Any:
    import multiprocessing.queues

    base_handler = multiprocessing.queues.Queue._on_queue_feeder_error  # type: ignore[attr-defined]

    def put(self: Any, obj: Any, block: bool = True, timeout: float | None = None) -> Any:
        # A queue that handles its feeder thread's errors itself (concurrent.futures' call queue fails the job's
        # future) gets the pickling error there, from the guarded reducers: raised here, it killed the pool's
        # manager thread, and the future and every later job of the pool waited forever.
        if type(self)._on_queue_feeder_error is not base_handler:
            return original(self, obj, block, timeout)
        if _lib().runtime_started() and _contains_neuron_tensor(obj):
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            if info is not None and isinstance(obj, tuple) and len(obj) == 2:
                # A DataLoader worker's (index, batch): hand the error to the main process, which re-raises
                # it at once (as for any error of a dataset), instead of a worker that dies or data that
                # never arrives.
                from torch._utils import ExceptionWrapper

                try:
                    raise RuntimeError(_SHARING_ERROR)
                except RuntimeError:
                    wrapped = ExceptionWrapper(where=f"in DataLoader worker process {info.id}")
                return original(self, (obj[0], wrapped), block, timeout)
            raise RuntimeError(_SHARING_ERROR)
        return original(self, obj, block, timeout)

    put._tnl_guard = True  # type: ignore[attr-defined]
    return put


def _install_multiprocessing_guards() -> None:
    import multiprocessing.queues
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions

    reducers = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    shared_types = (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)
    for cls in list(reducers):
        guarded = getattr(reducers[cls], "_tnl_guard", False)
        if isinstance(cls, type) and issubclass(cls, shared_types) and not guarded:
            reducers[cls] = _guard_reducer(reducers[cls])
    queue_cls = multiprocessing.queues.Queue
    if not getattr(queue_cls.put, "_tnl_guard", False):
        queue_cls.put = _guard_queue_put(queue_cls.put)  # type: ignore[method-assign]



def _install_storage_and_dlpack_fixes() -> None:
    """Two torch methods that do not know a renamed PrivateUse1 device or a queued one:

    - ``UntypedStorage.byteswap`` swaps the bytes on the host at once (``mutable_data()``), under kernels
      still queued to write them: a neuron storage's device is synchronised first.
    - ``Tensor.__dlpack_device__`` compares the device type with the literal ``"privateuse1"``, so
      ``torch.from_dlpack(neuron_tensor)`` raised ``Unknown device type neuron``: a neuron tensor is
      DLPack's ``kDLExtDev`` (what ``to_dlpack``'s capsule already says).
    """
    byteswap = torch.UntypedStorage.byteswap
    if not getattr(byteswap, "_tnl_guard", False):

        def guarded_byteswap(self: torch.UntypedStorage, dtype: torch.dtype) -> None:
            if self.device.type == "neuron":
                synchronize(self.device)
            return byteswap(self, dtype)

        guarded_byteswap._tnl_guard = True  # type: ignore[attr-defined]
        torch.UntypedStorage.byteswap = guarded_byteswap  # type: ignore[method-assign]
    dlpack_device = torch.Tensor.__dlpack_device__
    if not getattr(dlpack_device, "_tnl_guard", False):
        from torch.utils.dlpack import DLDeviceType

        def neuron_dlpack_device(self: torch.Tensor) -> tuple[Any, int]:
            if self.device.type == "neuron":
                return (DLDeviceType.kDLExtDev, self.device.index)
            return dlpack_device(self)

        neuron_dlpack_device._tnl_guard = True  # type: ignore[attr-defined]
        torch.Tensor.__dlpack_device__ = neuron_dlpack_device  # type: ignore[method-assign]


_install_multiprocessing_guards()
_install_storage_and_dlpack_fixes()
