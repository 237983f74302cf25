"""``torch.neuron``: the device module of the emulated NeuronCore, shaped like ``torch.cuda``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from . import memory  # torch.neuron.memory, like torch.cuda.memory
from ._backend import lib as _lib
from .memory import _device_index as _memory_device_index
from .memory import (
    _dump_snapshot,
    _record_memory_history,
    _snapshot,
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_stats_as_nested_dict,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_max_memory_allocated,
    reset_peak_memory_stats,
)

__all__ = [
    "_dump_snapshot",
    "_record_memory_history",
    "_snapshot",
    "current_device",
    "default_generators",
    "device",
    "device_count",
    "device_of",
    "empty_cache",
    "get_amp_supported_dtype",
    "get_device_capability",
    "get_device_name",
    "get_device_properties",
    "get_rng_state",
    "get_rng_state_all",
    "init",
    "initial_seed",
    "is_available",
    "is_bf16_supported",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_summary",
    "reset_accumulated_memory_stats",
    "reset_max_memory_allocated",
    "reset_peak_memory_stats",
    "seed",
    "seed_all",
    "set_device",
    "set_rng_state",
    "set_rng_state_all",
    "synchronize",
]

_DeviceLike = torch.device | str | int | None


def _index(dev: _DeviceLike) -> int:
    return _memory_device_index(dev)


def is_available() -> bool:
    """Always True: the emulated device runs wherever the C++ core builds."""
    return True


def is_initialized() -> bool:
    """True once any neuron device has allocated memory."""
    return bool(_lib().runtime_started())


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


def set_device(device: _DeviceLike) -> None:
    """Set the current neuron device (like ``torch.cuda.set_device``)."""
    _lib().set_device(_index(device))


class device:
    """Context manager that changes the current neuron device (like ``torch.cuda.device``)."""

    def __init__(self, device: _DeviceLike) -> None:
        self.idx = -1 if device is None else _index(device)
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


def synchronize(device: _DeviceLike = None) -> None:
    """Wait for the device. Kernels run synchronously, so this only records a sync event."""
    _lib().synchronize(_index(device))


def get_device_name(device: _DeviceLike = None) -> str:
    from . import profile

    return f"Emulated NeuronCore ({profile().name}, host CPU kernels)"


def get_device_properties(device: _DeviceLike = None) -> dict[str, Any]:
    from . import current_config, profile

    idx = _index(device)
    cfg = current_config()
    prof = profile()
    return {
        "name": get_device_name(idx),
        "index": idx,
        "total_memory": int(_lib().capacity(idx)),
        "profile": prof.name,
        "emulated": True,
        "num_devices": cfg["num_devices"],
    }


def get_amp_supported_dtype() -> list[torch.dtype]:
    """Dtypes ``torch.autocast("neuron", dtype=...)`` accepts."""
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# ---- random number generation (per-device generators, like torch.cuda.random) ----


class _DefaultGenerators(tuple):  # type: ignore[type-arg]
    pass


def _generators() -> tuple[torch.Generator, ...]:
    C = _lib()
    return tuple(C.default_generator(i) for i in range(device_count()))


def __getattr__(name: str) -> Any:  # module attribute: built lazily, never initialises memory
    if name == "default_generators":
        return _generators()
    raise AttributeError(f"module 'torch.neuron' has no attribute {name!r}")


def _gen(device: _DeviceLike) -> torch.Generator:
    return _lib().default_generator(_index(device))


def manual_seed(seed: int) -> None:
    """Seed the current neuron device's generator."""
    _gen(None).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _gen(i).manual_seed(int(seed))


def seed() -> None:
    _gen(None).seed()


def seed_all() -> None:
    for i in range(device_count()):
        _gen(i).seed()


def initial_seed() -> int:
    return int(_gen(None).initial_seed())


def get_rng_state(device: _DeviceLike = "neuron") -> torch.Tensor:
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


@contextlib.contextmanager
def _stream_ctx() -> Iterator[None]:  # kernels are synchronous; one default stream per device
    yield


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
    """Walk ``obj`` as pickle would (tensors and storages are not serialised, only inspected)."""
    import pickle

    found = False

    class _Probe(pickle.Pickler):
        def reducer_override(self, o: Any) -> Any:
            nonlocal found
            if isinstance(o, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
                if _is_neuron(o):
                    found = True
                    raise RuntimeError(_SHARING_ERROR)
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
    def put(self: Any, obj: Any, block: bool = True, timeout: float | None = None) -> Any:
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


_install_multiprocessing_guards()
