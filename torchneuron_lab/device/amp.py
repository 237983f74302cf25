"""``torch.neuron.amp``: torch.cuda.amp's names for the neuron device (``autocast``, ``GradScaler``,
``custom_fwd``, ``custom_bwd``), deprecated as torch.cuda.amp's are in favour of ``torch.amp.*("neuron")``.

CUDA code written as ``torch.cuda.amp.GradScaler()`` / ``torch.cuda.amp.autocast()`` keeps working when
``cuda`` becomes ``neuron``: each name warns with torch.cuda.amp's ``FutureWarning`` text for neuron and
does what ``torch.amp`` does with ``device_type="neuron"``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GradScaler", "amp_definitely_not_available", "autocast", "custom_bwd", "custom_fwd"]


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"`torch.neuron.amp.{old}` is deprecated. Please use `{new}` instead.", FutureWarning, stacklevel=3)


def amp_definitely_not_available() -> bool:
    """Whether no neuron device is there for autocast (torch.cuda.amp's question, asked of neuron)."""
    from .neuron_module import is_available

    return not is_available()


class autocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast("neuron", ...)``; float16 by default, as torch.cuda.amp.autocast."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> None:
        _deprecated("autocast(args...)", "torch.amp.autocast('neuron', args...)")
        super().__init__("neuron", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler("neuron", ...)``."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        _deprecated("GradScaler(args...)", "torch.amp.GradScaler('neuron', args...)")
        super().__init__("neuron", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)


def custom_fwd(fwd: Callable[..., Any] | None = None, *, cast_inputs: torch.dtype | None = None) -> Any:
    """``torch.amp.custom_fwd(fwd, device_type="neuron", cast_inputs=...)``."""
    _deprecated("custom_fwd(args...)", "torch.amp.custom_fwd(args..., device_type='neuron')")
    return torch.amp.custom_fwd(fwd, device_type="neuron", cast_inputs=cast_inputs)


def custom_bwd(bwd: Callable[..., Any] | None = None) -> Any:
    """``torch.amp.custom_bwd(bwd, device_type="neuron")``."""
    _deprecated("custom_bwd(args...)", "torch.amp.custom_bwd(args..., device_type='neuron')")
    return torch.amp.custom_bwd(bwd, device_type="neuron")
