"""Dynamo/Inductor's device runtime interface for ``neuron`` (``torch._dynamo.device_interface``).

Inductor and Dynamo ask this interface for the current device, device count, synchronisation and
properties of any device a graph touches ("No interface for device neuron" without it). It forwards to
``torch.neuron`` (shaped like ``torch.cuda``). The emulated device has no Triton.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.device_interface import DeviceInterface, register_interface_for_device

from ..device import DEVICE_TYPE

__all__ = ["NeuronInterface", "register"]


def _mod() -> Any:
    return getattr(torch, DEVICE_TYPE)


def _index(device: Any) -> int:
    if device is None:
        return int(_mod().current_device())
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return int(d.index) if d.index is not None else int(_mod().current_device())


class NeuronInterface(DeviceInterface):
    """``torch.neuron`` seen through Inductor's device-agnostic runtime interface."""

    class device:  # noqa: N801 - Inductor's name
        def __new__(cls, device: Any) -> Any:
            return _mod().device(_index(device))

    Event = torch.Event
    Stream = torch.Stream

    class Worker:
        @staticmethod
        def set_device(device: int) -> None:
            _mod().set_device(device)

        @staticmethod
        def current_device() -> int:
            return int(_mod().current_device())

        @staticmethod
        def get_device_properties(device: Any = None) -> Any:
            return _mod().get_device_properties(_index(device))

    @staticmethod
    def current_device() -> int:
        return int(_mod().current_device())

    @staticmethod
    def set_device(device: Any) -> None:
        _mod().set_device(_index(device))

    @staticmethod
    def maybe_exchange_device(device: int) -> int:
        prev = int(_mod().current_device())
        if device != prev:
            _mod().set_device(device)
        return prev

    @staticmethod
    def exchange_device(device: int) -> int:
        return NeuronInterface.maybe_exchange_device(device)

    @staticmethod
    def device_count() -> int:
        return int(_mod().device_count())

    @staticmethod
    def is_available() -> bool:
        return bool(_mod().is_available())

    # torch.neuron's own, as CUDA's interface has torch.cuda's: Dynamo turns a call of a registered
    # interface's `stream` into a stream context in the graph (it inlined the lab's Python StreamContext
    # and broke the graph 5 times), and `current_stream` is the current stream (a new torch.Stream before).
    stream = staticmethod(_mod().stream)
    current_stream = staticmethod(_mod().current_stream)
    set_stream = staticmethod(_mod().set_stream)

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        return int(_mod().current_stream(device_idx).stream_id)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        _mod().synchronize(device)

    @staticmethod
    def get_compute_capability(device: Any = None) -> str:
        return ""  # no CUDA-style capability; Triton is not available for neuron

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return bool(_mod().is_bf16_supported())

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return int(_mod().memory_allocated(device))

    @staticmethod
    def is_triton_capable(device: Any = None) -> bool:
        return False


def register() -> None:
    """Register the interface for ``neuron`` and ``neuron:i`` (idempotent)."""
    register_interface_for_device(DEVICE_TYPE, NeuronInterface)
    for i in range(int(_mod().device_count())):
        register_interface_for_device(f"{DEVICE_TYPE}:{i}", NeuronInterface)
