"""The emulated NeuronCore device: registration, configuration and the runtime interface.

Everything above this layer (compiler, extension, widgets) reaches the device through the names
exported here and through ``torch.neuron``; a real TorchNeuron install could take the emulator's
place behind the same interface.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .profiles import DeviceProfile, default_profile, get_profile

__all__ = [
    "DEVICE_TYPE",
    "configure",
    "current_config",
    "is_registered",
    "profile",
    "register",
]

DEVICE_TYPE = "neuron"
_lock = threading.RLock()
_registered = False
_config: dict[str, Any] = {}


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(float(raw)) if "e" in raw.lower() else int(raw, 0)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    return value


def _resolve(num_devices: int | None, hbm_bytes: int | None, profile_name: str | None) -> dict[str, Any]:
    prof = get_profile(profile_name or os.environ.get("TORCHNEURON_LAB_PROFILE") or default_profile().name)
    n = num_devices if num_devices is not None else _env_int("TORCHNEURON_LAB_NUM_DEVICES")
    hbm = hbm_bytes if hbm_bytes is not None else _env_int("TORCHNEURON_LAB_HBM_BYTES")
    n = 2 if n is None else n
    hbm = prof.hbm_bytes if hbm is None else hbm
    if not isinstance(n, int) or not 1 <= n <= 64:
        raise ValueError(f"num_devices must be an int in [1, 64], got {n!r}")
    if not isinstance(hbm, int) or hbm < (1 << 20):
        raise ValueError(f"hbm_bytes must be an int >= 1 MiB (1048576), got {hbm!r}")
    return {"num_devices": n, "hbm_bytes": hbm, "profile": prof.name}


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
        if not hasattr(torch.Tensor, "is_neuron"):
            torch.utils.generate_methods_for_privateuse1_backend(
                for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
            )
        _registered = True
