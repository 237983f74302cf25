"""torch.distributed on neuron: the ``neuron`` process-group backend.

``torch.distributed.init_process_group("neuron")`` (or no backend at all: ``neuron`` is the accelerator's default,
as NCCL is CUDA's) makes a process group whose collectives on neuron tensors are enqueued on a communication
stream of the tensors' device, as NCCL's are on its own CUDA stream: the host returns at once, the stream runs
the collective after the work the caller's stream had launched, and ``work.wait()`` makes the caller's current
stream wait for it. The transport between ranks is Gloo over the same store, on host aliases of the device's
memory (the emulated device's memory is host memory): no copy. CPU tensors in the same group go to Gloo as
they are. Each collective is a kernel of the device's timeline (engine ``dma``, named ``collective: ...``) on
the communication stream, so a profile shows communication overlapping computation (DistributedDataParallel's
bucketed all-reduces during backward) or not. C++: ``device/csrc/collectives.cpp``.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["collective_stream", "register_backend"]

_lock = threading.Lock()
_registered = False


def _create_backend(store: Any, rank: int, size: int, timeout: Any) -> Any:
    from torch.distributed import ProcessGroupGloo

    from ..device._backend import lib

    host = ProcessGroupGloo(store, rank, size, timeout)
    return lib().make_neuron_backend(host, rank, size)


def register_backend() -> None:
    """Registers ``neuron`` with torch.distributed (idempotent; called when the device is registered)."""
    global _registered
    with _lock:
        if _registered:
            return
        import torch.distributed as dist

        if not dist.is_available() or not hasattr(dist, "ProcessGroupGloo"):
            return
        if "neuron" not in dist.Backend.backend_list:
            dist.Backend.register_backend("neuron", _create_backend, devices=["cpu", "neuron"])
        _registered = True


def collective_stream(group: Any = None, device: Any = None) -> Any:
    """The ``torch.neuron.Stream`` that the collectives of ``group`` (default: the world) run on for ``device``
    (default: the current neuron device), as the timeline shows it."""
    import torch
    import torch.distributed as dist

    from ..device import neuron_module as nm
    from ..device._backend import lib

    index = nm._index(device)
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("neuron", index))
    sid = int(lib().collective_stream(backend, index))
    return nm.Stream(stream_id=sid, device_index=index, device_type=nm._device_type_code())
