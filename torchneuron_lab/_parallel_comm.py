"""``torch.nn.parallel.comm`` on neuron tensors: what ``nn.DataParallel`` calls.

``nn.DataParallel`` takes the PrivateUse1 device as its accelerator (``torch._utils._get_available_device_type``)
and moves tensors with ``torch.nn.parallel.comm``'s ``broadcast_coalesced`` / ``scatter`` / ``gather``, which
call C++ functions of torch's CUDA build (``torch._C._broadcast_coalesced``, ``_scatter``, ``_gather`` ...). The
CPU build has none of them: ``AttributeError: module 'torch._C' has no attribute '_scatter'``. Where they are
missing, this module provides them for neuron tensors with CUDA's semantics, as device-to-device copies the
device queues (ordered with both devices' streams, as ``Tensor.to`` between neuron devices is):

- ``_broadcast_coalesced(tensors, devices, buffer_size)``: one list per device; the first device's list holds the
  tensors themselves (they must be on it), the others copies (``buffer_size`` only chunks CUDA's transfers);
- ``_broadcast`` / ``_broadcast_out``: the same for one tensor;
- ``_scatter(tensor, devices, chunk_sizes, dim, streams)``: the chunks (``split_with_sizes`` or ``chunk``) on
  each device, copied on the given streams; a chunk already on its device is that chunk, as in CUDA's;
- ``_gather(tensors, dim, destination)``: one tensor on ``destination`` (an index, or -1 for the CPU), each
  part copied into its slice;
- ``_scatter_out`` / ``_gather_out``: into given tensors.

Each raises CUDA's error for arguments of the wrong shape, and a ``RuntimeError`` for tensors that are not on
neuron (what the CUDA build's functions would need a GPU for).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions: install() runs while torch itself may still be importing (its
# backend autoload registers the device), as torchneuron_lab._inductor_redirect does.

_NAMES = ("_broadcast_coalesced", "_broadcast", "_broadcast_out", "_scatter", "_scatter_out", "_gather",
          "_gather_out")


def _check_neuron(t: torch.Tensor, what: str) -> None:
    if t.device.type != "neuron":
        raise RuntimeError(f"torch._C.{what}: expected neuron tensors, got one on {t.device} (this build of torch "
                           "has no CUDA communication functions; torchneuron_lab provides them for neuron tensors)")


def _dev(index: int) -> torch.device:
    import torch

    return torch.device("neuron", index)


def _broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int],
                         buffer_size: int = 10485760) -> list[list[torch.Tensor]]:
    devices = [int(d) for d in devices]
    if not devices:
        raise RuntimeError("broadcast_coalesced: expected at least one device")
    for t in tensors:
        _check_neuron(t, "_broadcast_coalesced")
        if t.get_device() != devices[0]:
            raise RuntimeError(f"broadcast_coalesced: all tensors must be on devices[0]: {devices[0]}, "
                               f"got one on neuron:{t.get_device()}")
    out: list[list[torch.Tensor]] = [list(tensors)]
    for d in devices[1:]:
        out.append([t.to(_dev(d), non_blocking=True) for t in tensors])
    return out


def _broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
    return [ts[0] for ts in _broadcast_coalesced([tensor], devices)]


def _broadcast_out(tensor: torch.Tensor, out_tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    _check_neuron(tensor, "_broadcast_out")
    for o in out_tensors:
        _check_neuron(o, "_broadcast_out")
        if o.shape != tensor.shape:
            raise RuntimeError(f"output tensor shape {tuple(o.shape)} does not match the input's "
                               f"{tuple(tensor.shape)} (broadcast)")
        o.copy_(tensor, non_blocking=True)
    return list(out_tensors)


def _on_stream(streams: Sequence[Any] | None, i: int) -> contextlib.AbstractContextManager[Any]:
    import torch

    s = streams[i] if streams is not None and i < len(streams) else None
    return torch.neuron.stream(s) if s is not None else contextlib.nullcontext()  # type: ignore[attr-defined]


def _scatter(tensor: torch.Tensor, devices: Sequence[int], chunk_sizes: Sequence[int] | None = None, dim: int = 0,
             streams: Sequence[Any] | None = None) -> list[torch.Tensor]:
    _check_neuron(tensor, "_scatter")
    devices = [int(d) for d in devices]
    if not devices:
        raise RuntimeError("Expected at least one device to scatter to")
    if chunk_sizes is not None:
        if len(chunk_sizes) != len(devices):
            raise RuntimeError(f"Expected devices and chunk_sizes to be of same length, but got len(devices) = "
                               f"{len(devices)} and len(chunk_sizes) = {len(chunk_sizes)}")
        chunks = tensor.split_with_sizes(list(chunk_sizes), dim)
    else:
        chunks = tensor.chunk(len(devices), dim)
    out = []
    for i, (chunk, d) in enumerate(zip(chunks, devices)):
        with _on_stream(streams, i):
            out.append(chunk.to(_dev(d), non_blocking=True))
    return out


def _scatter_out(tensor: torch.Tensor, out_tensors: Sequence[torch.Tensor], dim: int = 0,
                 streams: Sequence[Any] | None = None) -> list[torch.Tensor]:
    _check_neuron(tensor, "_scatter_out")
    if not out_tensors:
        raise RuntimeError("Expected at least one output tensor to scatter to")
    sizes = [o.size(dim) for o in out_tensors]
    if sum(sizes) != tensor.size(dim):
        raise RuntimeError(f"Total size for output tensors along scatter dim ({sum(sizes)}) does not match the "
                           f"size of the input tensor along that dim ({tensor.size(dim)})")
    for i, (chunk, o) in enumerate(zip(tensor.split_with_sizes(sizes, dim), out_tensors)):
        _check_neuron(o, "_scatter_out")
        with _on_stream(streams, i):
            o.copy_(chunk, non_blocking=True)
    return list(out_tensors)


def _gather_out(tensors: Sequence[torch.Tensor], out_tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    if not tensors:
        raise RuntimeError("Expected at least one tensor to gather from")
    first = tensors[0]
    for t in tensors:
        _check_neuron(t, "_gather")
        if t.dim() != first.dim() or any(t.size(k) != first.size(k) for k in range(t.dim()) if k != dim % t.dim()):
            raise RuntimeError(f"Input tensor at index {list(tensors).index(t)} has invalid shape "
                               f"{list(t.shape)}, but expected {list(first.shape)} outside dim {dim}")
    total = sum(t.size(dim) for t in tensors)
    if out_tensor.size(dim) != total:
        raise RuntimeError(f"Expected out tensor to have size {total} along dim {dim}, got {out_tensor.size(dim)}")
    offset = 0
    for t in tensors:
        n = t.size(dim)
        out_tensor.narrow(dim, offset, n).copy_(t, non_blocking=True)
        offset += n
    return out_tensor


def _gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination: int | None = None) -> torch.Tensor:
    if not tensors:
        raise RuntimeError("Expected at least one tensor to gather from")
    import torch

    first = tensors[0]
    _check_neuron(first, "_gather")
    shape = list(first.shape)
    shape[dim] = sum(t.size(dim) for t in tensors)
    where = torch.device("cpu") if destination == -1 else _dev(first.get_device() if destination is None
                                                                  else int(destination))
    out = torch.empty(shape, dtype=first.dtype, device=where)
    return _gather_out(tensors, out, dim)


def install() -> None:
    """Add the functions torch's CPU build lacks (idempotent; a CUDA build keeps its own)."""
    import torch

    for name in _NAMES:
        if not hasattr(torch._C, name):
            setattr(torch._C, name, globals()[name])
