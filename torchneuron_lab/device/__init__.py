"""The emulated NeuronCore device: registration, configuration and the runtime interface.

Everything above this layer (compiler, extension, widgets) reaches the device through the names
exported here and through ``torch.neuron``; a real TorchNeuron install could take the emulator's
place behind the same interface.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .profiles import DeviceProfile, default_profile, get_profile

__all__ = [
    "DEVICE_TYPE",
    "configure",
    "current_config",
    "is_registered",
    "launch_blocking",
    "profile",
    "register",
]

DEVICE_TYPE = "neuron"
_lock = threading.RLock()
_registered = False
_config: dict[str, Any] = {}


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_size(raw: str, what: str = "value") -> int:
    """``'67108864'``, ``'64MiB'``, ``'1.5 GiB'``, ``'2e9'`` -> bytes; ``ValueError`` naming the value otherwise."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|0[xX][0-9a-fA-F]+)\s*([A-Za-z]*)\s*", raw)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{what}={raw!r} is not a size; use bytes or a unit such as 64MiB, 24GiB, 2e9")
    num = m.group(1)
    value = int(num, 16) if num.lower().startswith("0x") else float(num)
    return int(value * _UNITS[unit])


def _env_int(name: str, *, size: bool = False) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    if size:
        return parse_size(raw, name)
    try:
        return int(raw, 0)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _resolve(num_devices: int | None, hbm_bytes: int | None, profile_name: str | None) -> dict[str, Any]:
    """The configuration from the arguments, else the environment, else the defaults; a bad value raises
    ``ValueError`` naming where it came from (the argument or the ``TORCHNEURON_LAB_*`` variable)."""
    env_profile = os.environ.get("TORCHNEURON_LAB_PROFILE")
    try:
        prof = get_profile(profile_name or env_profile or default_profile().name)
    except ValueError as e:
        src = "profile" if profile_name else "TORCHNEURON_LAB_PROFILE"
        raise ValueError(f"{src}: {e}") from None
    n_src, hbm_src = "num_devices", "hbm_bytes"
    n, hbm = num_devices, hbm_bytes
    if n is None:
        n, n_src = _env_int("TORCHNEURON_LAB_NUM_DEVICES"), "TORCHNEURON_LAB_NUM_DEVICES"
    if hbm is None:
        hbm, hbm_src = _env_int("TORCHNEURON_LAB_HBM_BYTES", size=True), "TORCHNEURON_LAB_HBM_BYTES"
    n = 2 if n is None else n
    hbm = prof.hbm_bytes if hbm is None else hbm
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
        raise ValueError(f"{n_src} must be an int in [1, 64], got {n!r}")
    if isinstance(hbm, bool) or not isinstance(hbm, int) or not (1 << 20) <= hbm <= (1 << 62):
        # (the C++ core takes a signed 64-bit size: 1e99 failed there with a TypeError)
        raise ValueError(f"{hbm_src} must be an int in [1 MiB, 4 EiB] (1048576 to 2**62), got {hbm!r}")
    return {"num_devices": n, "hbm_bytes": hbm, "profile": prof.name}


#: Switches the C++ core reads at first use (``queue.cpp``) or the compiler reads per graph. The core would
#: take a value it does not know for the default (``TORCHNEURON_LAB_LAUNCH_BLOCKING=true`` ran asynchronously,
#: the opposite of what was asked), so a bad value is refused at registration, as the configuration's are.
_RUNTIME_SWITCHES: dict[str, tuple[str, ...]] = {
    "TORCHNEURON_LAB_LAUNCH_BLOCKING": ("0", "1"),
    "TORCHNEURON_LAB_SPIN_THROTTLE": ("auto", "on", "off", "0", "1"),
    "TORCHNEURON_LAB_QUEUE_GRAPHS": ("0", "1"),
    "TORCHNEURON_LAB_VERBOSE_BUILD": ("0", "1"),
}
#: Waits in seconds, each bounded: a positive, finite number (``inf`` would be an unbounded wait).
_RUNTIME_SECONDS = ("TORCHNEURON_LAB_SYNC_TIMEOUT", "TORCHNEURON_LAB_BUILD_TIMEOUT")


def check_runtime_env() -> None:
    """Raise ``ValueError`` naming the variable for a ``TORCHNEURON_LAB_*`` runtime switch the core would ignore."""
    for name, allowed in _RUNTIME_SWITCHES.items():
        raw = os.environ.get(name)
        if raw and raw not in allowed:
            raise ValueError(f"{name}={raw!r}: must be one of {', '.join(allowed)}")
    for name in _RUNTIME_SECONDS:
        raw = os.environ.get(name)
        if raw:
            try:
                seconds = float(raw)
            except ValueError:
                seconds = float("nan")
            if not (0 < seconds < float("inf")):  # every wait has a bound: no 0, negative, inf or nan
                raise ValueError(f"{name}={raw!r}: must be a positive, finite number of seconds")


@contextlib.contextmanager
def launch_blocking(enabled: bool = True) -> Iterator[None]:
    """Inside the block every kernel runs on the host at its launch (``TORCHNEURON_LAB_LAUNCH_BLOCKING=1``
    for a region, as ``CUDA_LAUNCH_BLOCKING`` for a process): errors are raised by the line that caused
    them, and memory peaks are the program's own (no kernel is queued while the host allocates ahead).
    The device's queues are drained first; the previous mode is restored on exit."""
    from ._backend import lib

    C = lib()
    previous = bool(C.launch_blocking())
    C.synchronize(int(C.current_device()))
    C.set_launch_blocking(bool(enabled))
    try:
        yield
    finally:
        C.set_launch_blocking(previous)


def configure(
    num_devices: int | None = None, hbm_bytes: int | None = None, profile: str | None = None
) -> dict[str, Any]:
    """Set the number of emulated devices, their HBM capacity and the device profile.

    Works before the first neuron tensor exists (environment variables ``TORCHNEURON_LAB_NUM_DEVICES``,
    ``TORCHNEURON_LAB_HBM_BYTES``, ``TORCHNEURON_LAB_PROFILE`` give the defaults). Once a device has
    allocated memory, a different configuration raises ``RuntimeError``; the same one is accepted.
    """
    global _config
    with _lock:
        cfg = _resolve(num_devices, hbm_bytes, profile)
        from ._backend import lib

        lib().configure(cfg["num_devices"], cfg["hbm_bytes"])  # raises once a device is in use
        _config = cfg
        return dict(cfg)


def current_config() -> dict[str, Any]:
    """The configuration in force: ``num_devices``, ``hbm_bytes``, ``profile``."""
    with _lock:
        if not _config:
            return _resolve(None, None, None)
        return dict(_config)


def profile() -> DeviceProfile:
    """The device profile whose published figures feed the (estimated) roofline times."""
    return get_profile(current_config()["profile"])


def is_registered() -> bool:
    return _registered


def register() -> None:
    """Register the ``neuron`` device with PyTorch. Idempotent and thread-safe."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        import torch

        check_runtime_env()
        from ._backend import lib

        C = lib()
        if not C.runtime_started() and not _config:
            configure()
        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", DEVICE_TYPE):
            raise RuntimeError(
                f"PrivateUse1 is already registered as {name!r}; torchneuron_lab needs it for 'neuron'"
            )
        torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        from . import neuron_module

        if not hasattr(torch, DEVICE_TYPE):
            torch._register_device_module(DEVICE_TYPE, neuron_module)
        # `from torch.neuron.memory import _record_memory_history` (the form torch.cuda's memory docs use)
        sys.modules.setdefault(f"torch.{DEVICE_TYPE}.memory", neuron_module.memory)
        sys.modules.setdefault(f"torch.{DEVICE_TYPE}.amp", neuron_module.amp)
        if not hasattr(torch.Tensor, "is_neuron"):
            torch.utils.generate_methods_for_privateuse1_backend(
                for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
            )
        from . import _jagged_sdpa

        _jagged_sdpa.install()  # SDPA on jagged nested tensors on neuron (torch's math path needs strided ones)
        _follow_host_cpu_settings(torch, C)
        _registered = True


def _follow_host_cpu_settings(torch: Any, C: Any) -> None:
    """Make ``torch.set_num_threads`` and ``torch.set_flush_denormal`` reach the device's threads.

    Both settings are per thread in ATen (a thread takes the intra-op thread count once, at its first parallel
    region; flush-denormal is a register of the thread that sets it), so a worker that had run a kernel kept
    the old ones and its reductions stopped being CPU's. Each call is recorded with the device, and a thread
    adopts the new values before its next kernel (``adopt_host_cpu_settings`` in csrc/queue.cpp).
    """
    import functools

    if getattr(torch.set_num_threads, "_tnl_follows", False):
        return
    set_num_threads, set_flush_denormal = torch.set_num_threads, torch.set_flush_denormal

    @functools.wraps(set_num_threads)
    def _set_num_threads(n: int, /) -> None:
        set_num_threads(n)
        C.set_host_cpu_settings(torch.get_num_threads(), -1)

    @functools.wraps(set_flush_denormal)
    def _set_flush_denormal(mode: Any) -> bool:
        supported = set_flush_denormal(mode)
        if supported:
            C.set_host_cpu_settings(0, 1 if mode else 0)
        return supported

    _set_num_threads._tnl_follows = True  # type: ignore[attr-defined]
    torch.set_num_threads = _set_num_threads
    torch.set_flush_denormal = _set_flush_denormal
