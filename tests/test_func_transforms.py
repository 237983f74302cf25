"""torch.func transforms (vmap, grad, jvp, jacfwd) over neuron tensors, against the same code on CPU (hostile
review, seventeenth session). Transforms wrap tensors in functorch's batched tensors and grad wrappers, which
have no storage; code of the device that CompositeImplicit ops reach before they unwrap (the attention
backend choice, a DispatchStub) must read only metadata."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacfwd, jvp, vmap

import torchneuron_lab  # noqa: F401  (registers the device)


def _on_both(make: Callable[[str], Any]) -> tuple[Any, Any]:
    torch.manual_seed(0)
    cpu = make("cpu")
    torch.manual_seed(0)
    neuron = make("neuron")
    return cpu, neuron


def _equal(cpu: Any, neuron: Any) -> None:
    cpu_leaves = torch.utils._pytree.tree_leaves(cpu)
    neuron_leaves = torch.utils._pytree.tree_leaves(neuron)
    assert len(cpu_leaves) == len(neuron_leaves) > 0
    for c, n in zip(cpu_leaves, neuron_leaves, strict=True):
        assert n.device.type == "neuron"
        assert torch.equal(c, n.cpu()), (c - n.cpu()).abs().max()


def _sdpa(**kw: Any) -> Callable[..., torch.Tensor]:
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)


SDPA_CASES: dict[str, Callable[[str], Any]] = {
    "vmap": lambda d: vmap(_sdpa())(*torch.randn(3, 3, 2, 4, 6, 8).to(d).unbind(0)),
    "vmap causal": lambda d: vmap(_sdpa(is_causal=True))(*torch.randn(3, 3, 2, 4, 6, 8).to(d).unbind(0)),
    "vmap mask": lambda d: vmap(_sdpa(attn_mask=torch.randn(6, 6).to(d)))(
        *torch.randn(3, 3, 2, 4, 6, 8).to(d).unbind(0)
    ),
    "vmap gqa": lambda d: vmap(_sdpa(enable_gqa=True))(
        torch.randn(3, 2, 4, 6, 8).to(d), *torch.randn(2, 3, 2, 2, 6, 8).to(d).unbind(0)
    ),
    "grad": lambda d: grad(lambda a: F.scaled_dot_product_attention(a, a, a).sum())(
        torch.randn(2, 4, 6, 8).to(d)
    ),
    "vmap of grad": lambda d: vmap(grad(lambda a: F.scaled_dot_product_attention(a, a, a).sum()))(
        torch.randn(3, 2, 4, 6, 8).to(d)
    ),
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_scaled_dot_product_attention_under_a_transform_is_cpus(case: str) -> None:
    # the attention backend choice aliased each input's storage: "Cannot access storage of BatchedTensorImpl"
    _equal(*_on_both(SDPA_CASES[case]))


FORWARD_AD_CASES: dict[str, Callable[[str], Any]] = {
    "jvp": lambda d: jvp(
        _sdpa(),
        tuple(torch.randn(3, 2, 4, 6, 8).to(d).unbind(0)),
        tuple(torch.randn(3, 2, 4, 6, 8).to(d).unbind(0)),
    ),
    "jacfwd": lambda d: jacfwd(lambda a: F.scaled_dot_product_attention(a, a, a).sum(-1))(
        torch.randn(1, 2, 3, 4).to(d)
    ),
}


@pytest.mark.parametrize("case", list(FORWARD_AD_CASES))
def test_attention_under_forward_ad_raises_cpus_error(case: str) -> None:
    # both devices choose the same backend, whose CPU kernel has no forward-AD formula in torch 2.13
    errors = []
    for device in ("cpu", "neuron"):
        with pytest.raises(NotImplementedError) as info:
            FORWARD_AD_CASES[case](device)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert "Trying to use forward AD with _scaled_dot_product_flash_attention_for_cpu" in errors[1]


def test_per_sample_gradients_of_a_training_transformer_layer_are_cpus() -> None:
    # the PyTorch tutorial's per-sample gradients: vmap(grad(functional_call)) over a layer in train mode
    def make(device: str) -> dict[str, torch.Tensor]:
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True).to(
            device
        )
        params = {k: v.detach() for k, v in layer.named_parameters()}
        x = torch.randn(4, 5, 16).to(device)
        target = torch.randn(4, 5, 16).to(device)

        def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, ti: torch.Tensor) -> torch.Tensor:
            out = functional_call(layer, p, (xi.unsqueeze(0),))
            return F.mse_loss(out, ti.unsqueeze(0))

        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, target)

    cpu, neuron = _on_both(make)
    assert set(neuron) == set(cpu) and len(cpu) == 12
    assert all(g.shape[0] == 4 for g in neuron.values())
    _equal(cpu, neuron)


def test_grad_through_multihead_attention_is_cpus() -> None:
    def make(device: str) -> dict[str, torch.Tensor]:
        mha = nn.MultiheadAttention(16, 4, batch_first=True).to(device)
        params = {k: v.detach() for k, v in mha.named_parameters()}
        x = torch.randn(2, 5, 16).to(device)

        def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(mha, p, (x, x, x), {"need_weights": False})[0].square().sum()

        return grad(loss)(params)

    _equal(*_on_both(make))


def test_compiled_vmap_over_attention_is_inductor_cpus() -> None:
    def make(device: str) -> torch.Tensor:
        torch._dynamo.reset()
        fn = torch.compile(vmap(_sdpa()), backend="inductor" if device == "cpu" else "neuron", fullgraph=True)
        return fn(*torch.randn(3, 3, 2, 4, 6, 8).to(device).unbind(0))

    cpu, neuron = _on_both(make)
    torch.testing.assert_close(neuron.cpu(), cpu, rtol=0, atol=1e-6)


@pytest.mark.parametrize("cell", ["GRUCell", "LSTMCell"])
def test_forward_ad_through_a_fused_rnn_cell_raises_as_on_cuda(cell: str) -> None:
    # torch.nn picks the fused cells (_thnn_fused_*_cell) for every non-CPU device; torch 2.13 has no forward
    # formula for them (documented in csrc/README.md). Reverse mode through the same cells is CPU's bit for bit.
    torch.manual_seed(0)
    m = getattr(nn, cell)(5, 4).to("neuron")
    x, t = torch.randn(3, 5, device="neuron"), torch.randn(3, 5, device="neuron")
    fused = "_thnn_fused_gru_cell" if cell == "GRUCell" else "_thnn_fused_lstm_cell"
    with pytest.raises(NotImplementedError, match=f"Trying to use forward AD with {fused}"):
        jvp(lambda a: m(a), (x,), (t,))
    params = {k: v.detach() for k, v in m.named_parameters()}
    got = grad(
        lambda p: torch.stack(
            list(functional_call(m, p, (x,))) if cell == "LSTMCell" else [functional_call(m, p, (x,))]
        ).sum()
    )(params)
    cpu = getattr(nn, cell)(5, 4)
    cpu.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
    cpu_params = {k: v.detach() for k, v in cpu.named_parameters()}
    xc = x.cpu()
    want = grad(
        lambda p: torch.stack(
            list(functional_call(cpu, p, (xc,))) if cell == "LSTMCell" else [functional_call(cpu, p, (xc,))]
        ).sum()
    )(cpu_params)
    _equal(want, got)
