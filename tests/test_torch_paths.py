"""Torch code that reaches the device through paths other than an op's kernel (issue 11's "what CUDA supports,
neuron supports"): a device module's flags, tensor and storage methods implemented in torch itself, factory
arguments, Generators. Each case silently gave wrong data or a different error than CPU/CUDA before (hostile
review, ninth session)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torchneuron_lab  # noqa: F401  (registers the device)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputes_dropout_with_the_forwards_mask(use_reentrant: bool) -> None:
    # checkpoint saves the device RNG state only when getattr(torch.<device>, "_initialized", False)
    def f(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5, training=True) * 3

    x = torch.ones(4096, device="neuron", requires_grad=True)
    y = checkpoint(f, x, use_reentrant=use_reentrant)
    y.sum().backward()
    kept = y.detach() != 0
    assert 1000 < int(kept.sum()) < 3096
    assert torch.equal(x.grad, kept.float() * 6)  # d/dx of 3 * dropout(x): 6 where kept, 0 where dropped
    assert torch.neuron._initialized is True


def test_a_neuron_generator_with_cpu_tensors_raises_cpus_error() -> None:
    # dispatched to neuron by the generator alone: a CPU tensor's in-place draw wrote a clone (the tensor
    # unchanged from the second call on), factories returned CPU tensors drawn from it
    g = torch.Generator(device="neuron").manual_seed(0)
    t = torch.full((4,), 7.0)
    msg = "Expected a 'cpu' device type for generator but found 'neuron'"
    for call in (
        lambda: t.uniform_(generator=g),
        lambda: t.normal_(generator=g),
        lambda: torch.rand(3, generator=g),
        lambda: torch.randn(3, generator=g),
        lambda: torch.randperm(5, generator=g),
        lambda: torch.multinomial(torch.ones(4), 2, generator=g),
    ):
        with pytest.raises(RuntimeError, match=msg):
            call()
    assert t.tolist() == [7.0] * 4
    assert torch.rand(3, generator=g, device="neuron").device.type == "neuron"  # the right device still works


@pytest.mark.parametrize("factory", [torch.empty, torch.zeros, torch.ones])
def test_pinned_memory_is_refused_for_device_tensors_as_cuda(factory: Any) -> None:
    with pytest.raises(RuntimeError, match="Only dense CPU tensors can be pinned"):
        factory(3, device="neuron", pin_memory=True)
    assert factory(3, device="neuron", pin_memory=False).device.type == "neuron"


def test_a_copy_into_a_destination_with_overlapping_elements_raises_at_the_call() -> None:
    # a queued device copy checked shapes on meta twins, which cannot see internal overlap: the error came
    # at the next unrelated sync
    src = torch.arange(4.0, device="neuron")
    dst = torch.zeros(1, device="neuron").expand(4)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        dst.copy_(src)
    assert (torch.ones(2, device="neuron") * 2).tolist() == [2.0, 2.0]  # no error left for the next sync


def test_storage_byteswap_waits_for_the_kernels_writing_the_storage() -> None:
    want = torch.ones(2)
    want.untyped_storage().byteswap(torch.float32)
    for _ in range(3):
        torch.neuron._sleep(100)
        x = torch.ones(2, device="neuron")  # its fill is queued behind the sleep
        x.untyped_storage().byteswap(torch.float32)
        assert torch.equal(x.cpu().view(torch.uint8), want.view(torch.uint8))


def test_from_dlpack_of_a_neuron_tensor() -> None:
    from torch.utils.dlpack import DLDeviceType

    x = torch.arange(6.0, device="neuron:1").view(2, 3)
    assert x.__dlpack_device__() == (DLDeviceType.kDLExtDev, 1)
    y = torch.from_dlpack(x)
    assert y.device == x.device and y.data_ptr() == x.data_ptr() and torch.equal(y.cpu(), x.cpu())
    assert torch.ones(2).__dlpack_device__() == (DLDeviceType.kDLCPU, 0)


def test_nested_tensors_jagged_run_and_strided_ones_raise_the_layout_error() -> None:
    import warnings

    parts = [torch.arange(2.0), torch.arange(3.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are in prototype stage"
        made = torch.nested.nested_tensor(parts, device="neuron")  # its buffer is a dense neuron tensor
        for use in (lambda: made * 2, lambda: made.unbind(), lambda: torch.nested.nested_tensor(parts).to("neuron")):
            with pytest.raises(NotImplementedError, match=r"would make a nested \(torch.strided layout\) tensor"):
                use()
        jagged = torch.nested.nested_tensor(parts, layout=torch.jagged, device="neuron")
        want = torch.nested.nested_tensor(parts, layout=torch.jagged)
        assert torch.equal((jagged * 2).to_padded_tensor(-1.0).cpu(), (want * 2).to_padded_tensor(-1.0))
