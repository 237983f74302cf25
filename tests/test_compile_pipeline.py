"""``torch.compile(backend="neuron")`` runs Inductor's whole pipeline, and results land where eager's do.

Issue 11: dropout (inference and training), a Conv2d/BatchNorm2d/ReLU/MaxPool2d/Conv2d training step
(channels-last strides of the CPU convolution must not leak into the neuron graph) and a Mamba-like block
compile and train; compiled numerics are compared against Inductor-CPU's own difference from eager on the
same program. The compiler device interface for ``neuron`` is registered.

Issue 10: compiled code returns tensors on exactly the device eager does (``neuron:1``, ``cpu``) and
raises eager's error for a device that does not exist (the emulator has 2 devices by default).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchneuron_lab  # noqa: F401  (registers the device)
from torchneuron_lab.compiler import registry


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield
    torch._dynamo.reset()


def _n_records() -> int:
    return len(registry.records())


# ---------------------------------------------------------------------------------------------------
# device interface


def test_compiler_device_interface_is_registered_for_neuron() -> None:
    from torch._dynamo.device_interface import get_interface_for_device

    iface = get_interface_for_device("neuron")
    assert get_interface_for_device(torch.device("neuron", 1)) is iface
    assert iface.device_count() == torch.neuron.device_count() == 2  # type: ignore[attr-defined]
    assert iface.is_available() is True
    assert iface.current_device() == torch.neuron.current_device()  # type: ignore[attr-defined]
    assert iface.is_triton_capable() is False
    prev = iface.exchange_device(1)
    try:
        assert torch.neuron.current_device() == 1  # type: ignore[attr-defined]
    finally:
        iface.set_device(prev)
    assert torch.neuron.current_device() == prev  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------
# dropout: replace_random (a joint-graph pass) must run


def _drop_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5))


def test_dropout_compiles_in_eval_and_no_grad() -> None:
    m = _drop_model().to("neuron").eval()
    x = torch.randn(32, 64).to("neuron")
    with torch.no_grad():
        out = torch.compile(m, backend="neuron")(x)
        ref = m(x)
    assert out.device == torch.device("neuron", 0)
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5)


def test_dropout_compiles_forward_under_no_grad_in_training_mode() -> None:
    m = _drop_model().to("neuron").train()
    x = torch.randn(32, 64).to("neuron")
    n0 = _n_records()
    with torch.no_grad():
        out = torch.compile(m, backend="neuron")(x)
        lin = m[0](x)
    kept = out.cpu() != 0
    # every kept element is the linear output scaled by 1 / (1 - p); about half are dropped
    torch.testing.assert_close(out.cpu()[kept], (lin.cpu() * 2)[kept], rtol=1e-5, atol=1e-5)
    assert 0.4 < kept.float().mean().item() < 0.6
    (rec,) = registry.records()[n0:]
    assert rec.kind == "inference"
    # replace_random turned aten.rand into Inductor's seeded random: no ATen rand left in the graph
    assert not any("rand" in op and "inductor" not in op for op in rec.op_counts), rec.op_counts


def test_dropout_trains_compiled_and_backward_uses_the_forward_mask() -> None:
    m = _drop_model().to("neuron").train()
    x = torch.randn(32, 64).to("neuron").requires_grad_(True)
    n0 = _n_records()
    out = torch.compile(m, backend="neuron")(x)
    out.backward(torch.ones_like(out))
    kept = (out.detach().cpu() != 0).float()
    # d out / d lin = mask * 2; so dx = (mask * 2) @ W
    w = m[0].weight.detach().cpu()
    torch.testing.assert_close(x.grad.cpu(), (kept * 2) @ w, rtol=1e-5, atol=1e-5)
    assert 0.4 < kept.mean().item() < 0.6
    assert [r.kind for r in registry.records()[n0:]] == ["forward", "backward"]


# ---------------------------------------------------------------------------------------------------
# training programs Inductor-CPU compiles; numerics within Inductor-CPU's own difference from eager


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 16, 3, padding=1),
        nn.Flatten(),
        nn.Linear(16 * 16 * 16, 10),
    )


class MambaLike(nn.Module):
    """The ops of a Mamba block: in-projection, causal depthwise conv1d, SiLU gate, a cumulative
    (scan-like) state with exp decay, out-projection, residual and RMS-style norm."""

    def __init__(self, d: int = 32, expand: int = 2, k: int = 4) -> None:
        super().__init__()
        e = d * expand
        self.in_proj = nn.Linear(d, 2 * e)
        self.conv = nn.Conv1d(e, e, k, groups=e, padding=k - 1)
        self.dt = nn.Linear(e, e)
        self.a_log = nn.Parameter(torch.randn(e) * 0.1)
        self.out_proj = nn.Linear(e, d)
        self.norm_w = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        xz = self.in_proj(x)
        u, z = xz.chunk(2, dim=-1)
        u = self.conv(u.transpose(1, 2))[..., :length].transpose(1, 2)
        u = F.silu(u)
        dt = F.softplus(self.dt(u))
        decay = torch.exp(-torch.exp(self.a_log) * dt)
        h = torch.cumsum(decay.log(), dim=1).exp() * torch.cumsum(u * dt, dim=1)
        y = h * F.silu(z)
        out = x + self.out_proj(y)
        return out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_w


def _cnn_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def _mamba_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 24, 32, generator=g), torch.randn(4, 24, 32, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out, y) if y.dtype == torch.int64 else F.mse_loss(out, y)


def _train(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], device: str, backend: str | None,
           steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    m = copy.deepcopy(model).to(device).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
    fn: Callable[..., torch.Tensor] = _loss
    if backend is not None:
        fn = torch.compile(_loss, backend=backend)
    x, y = (t.to(device) for t in data)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = fn(m, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in m.parameters()]


@pytest.mark.parametrize(("make", "data"), [(_cnn, _cnn_data), (MambaLike, _mamba_data)], ids=["cnn", "mamba"])
def test_training_compiles_and_stays_within_inductor_cpus_difference_from_eager(
    make: Callable[[], nn.Module], data: Callable[[], tuple[torch.Tensor, torch.Tensor]]
) -> None:
    torch.manual_seed(0)
    model = make()
    batch = data()
    n0 = _n_records()
    ours, p_ours = _train(model, batch, "neuron", "neuron")
    recs = registry.records()[n0:]
    assert [r.kind for r in recs] == ["forward", "backward"]
    assert recs[0].calls == recs[1].calls == 3
    eager_n, p_eager_n = _train(model, batch, "neuron", None)
    eager_c, p_eager_c = _train(model, batch, "cpu", None)
    ind, p_ind = _train(model, batch, "cpu", "inductor")
    assert eager_n == eager_c  # eager neuron is bit-identical to CPU
    d_ind = max(abs(a - b) for a, b in zip(ind, eager_c))
    d_ours = max(abs(a - b) for a, b in zip(ours, eager_n))
    assert d_ours <= max(2 * d_ind, 1e-6), (ours, ind, eager_n)
    for po, pe, pi, pc in zip(p_ours, p_eager_n, p_ind, p_eager_c):
        assert (po - pe).abs().max() <= max(2 * (pi - pc).abs().max().item(), 1e-6)


def test_channels_last_input_keeps_its_strides_through_the_compiled_graph() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 3, padding=1).to("neuron")
    x = torch.randn(2, 8, 6, 6).to("neuron").to(memory_format=torch.channels_last).requires_grad_(True)

    def f(t: torch.Tensor) -> torch.Tensor:
        return conv(t).relu()

    ref = f(x)
    out = torch.compile(f, backend="neuron")(x)
    assert out.stride() == ref.stride()
    torch.testing.assert_close(out.detach().cpu(), ref.detach().cpu(), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert x.grad is not None and x.grad.stride() == x.stride()


# ---------------------------------------------------------------------------------------------------
# issue 10: results on eager's device; eager's error where eager fails


def _ones_on_1() -> torch.Tensor:
    return torch.ones(3, device="neuron:1") * 3


def _to_1(x: torch.Tensor) -> torch.Tensor:
    return x.to("neuron:1") * 2


def _to_cpu(x: torch.Tensor) -> torch.Tensor:
    return x.cpu() * 2


def _both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x + 1, x.to("neuron:1") - 1, x.cpu() * 3


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        (_ones_on_1, ()),
        (_to_1, ("neuron:0",)),
        (_to_cpu, ("neuron:0",)),
        (_to_cpu, ("neuron:1",)),
        (_to_1, ("neuron:1",)),
        (_both, ("neuron:0",)),
    ],
    ids=["ones-neuron1", "to-neuron1", "to-cpu", "neuron1-to-cpu", "neuron1-to-neuron1", "three-devices"],
)
def test_compiled_results_are_on_eagers_devices(fn: Callable[..., Any], args: tuple[str, ...]) -> None:
    inputs = [torch.arange(3.0, device=d) for d in args]
    ref = fn(*inputs)
    out = torch.compile(fn, backend="neuron", fullgraph=True)(*inputs)
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = out if isinstance(out, tuple) else (out,)
    assert [o.device for o in outs] == [r.device for r in refs]
    for o, r in zip(outs, refs):
        assert torch.equal(o.cpu(), r.cpu())
    for o in outs:
        if o.device.type == "cpu":  # the CPU result owns CPU memory, not a device block
            assert o.untyped_storage().device.type == "cpu"
            o.add_(1)  # and is an ordinary writable CPU tensor


def test_compiled_cpu_result_does_not_hold_device_memory() -> None:
    x = torch.randn(256, 256).to("neuron")
    fn = torch.compile(_to_cpu, backend="neuron", fullgraph=True)
    fn(x)
    base = torch.neuron.memory_allocated()  # type: ignore[attr-defined]
    out = fn(x)
    assert torch.neuron.memory_allocated() == base  # type: ignore[attr-defined]
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, x.cpu() * 2)


def _ones_on_7() -> torch.Tensor:
    return torch.ones(2, device="neuron:7") + 1


def test_compiled_code_on_a_missing_device_raises_eagers_error() -> None:
    with pytest.raises(Exception) as eager:
        _ones_on_7()
    fn = torch.compile(_ones_on_7, backend="neuron")
    for _ in range(2):  # every call, not only the first
        with pytest.raises(type(eager.value)) as compiled:
            fn()
        # eager's message (Dynamo may prefix "backend='neuron' raised:" or append its TORCHDYNAMO_VERBOSE
        # hint on the call that compiled, depending on what compiled before in the process)
        assert str(eager.value) in str(compiled.value)
    assert "invalid neuron device index 7" in str(eager.value)
