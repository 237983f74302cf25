"""torchneuron_lab: an interactive eager-mode debugging lab for PyTorch on the ``neuron`` device.

``import torchneuron_lab`` registers the emulated ``neuron`` device with PyTorch (idempotent);
``%load_ext torchneuron_lab`` additionally registers the IPython magics. IPython and plotly are only
imported by the extension and widget layers.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "load_ipython_extension", "register_device", "unload_ipython_extension"]


def register_device() -> None:
    """Register the ``neuron`` device (builds the C++ core on first use). Safe to call repeatedly."""
    from .device import register

    register()


def _autoload() -> None:
    """``torch.backends`` entry point: ``import torch`` alone makes ``neuron`` available.

    A failure here (no compiler, a broken build) must not make ``import torch`` itself fail: it is
    reported as a warning, and ``import torchneuron_lab`` raises the full error.
    """
    try:
        register_device()
    except Exception as e:  # noqa: BLE001 - reported, and re-raised by an explicit import
        import warnings

        warnings.warn(f"torchneuron_lab: the neuron device could not be registered: {e}", stacklevel=2)


def load_ipython_extension(ipython: Any) -> None:
    from .extension import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .extension import unload_ipython_extension as _unload

    _unload(ipython)


# TORCHNEURON_LAB_REGISTER=0 imports the package without touching torch (e.g. to read saved traces).
if __import__("os").environ.get("TORCHNEURON_LAB_REGISTER", "1") != "0":
    register_device()
