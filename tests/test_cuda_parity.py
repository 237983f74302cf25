"""What CUDA supports, neuron supports (issue 11).

Libraries take CUDA-shaped paths on every non-CPU device: torch.nn's recurrent layers call ATen's fused
cell kernels (CUDA-only), scaled_dot_product_attention asks the device which fused kernel to use,
Hugging Face's MoE calls integer ``histc``. The device answers like CUDA (same ops, same dtypes) and
computes like the CPU (same numerics); out= tensors on another device raise CUDA's error.
The implementation is torchneuron_lab/device/csrc/cuda_parity.cpp.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torchneuron_lab  # noqa: F401  (registers the device)
from tests._neuron_child import run_child

MISMATCH = r"Expected all tensors to be on the same device, but found at least two devices, neuron:0 and cpu!"


def _pair(cls, *args, **kwargs):
    torch.manual_seed(0)
    cpu = cls(*args, **kwargs)
    dev = cls(*args, **kwargs)
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev.to("neuron")


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _state_loss(out) -> torch.Tensor:
    """Every output (including the returned states) enters the loss, so every backward path is used."""
    if isinstance(out, torch.Tensor):
        return out.pow(2).sum()
    return sum(_state_loss(o) for o in out)


# --------------------------------------------------------------------------- recurrent cells


@pytest.mark.parametrize("cls", [torch.nn.LSTMCell, torch.nn.GRUCell])
@pytest.mark.parametrize("bias", [True, False])
def test_cells_forward_backward_bit_identical_to_cpu(cls, bias) -> None:
    cpu, dev = _pair(cls, 6, 5, bias=bias)
    torch.manual_seed(1)
    x = torch.randn(3, 6)
    h = torch.randn(3, 5)
    state = (h, torch.randn(3, 5)) if cls is torch.nn.LSTMCell else h
    state_dev = tuple(s.to("neuron") for s in state) if isinstance(state, tuple) else state.to("neuron")
    xc = x.clone().requires_grad_()
    xd = x.to("neuron").requires_grad_()
    out_c, out_d = cpu(xc, state), dev(xd, state_dev)
    for a, b in zip(out_c if isinstance(out_c, tuple) else (out_c,), out_d if isinstance(out_d, tuple) else (out_d,)):
        assert b.device.type == "neuron"
        assert torch.equal(a, b.cpu())
    _state_loss(out_c).backward()
    _state_loss(out_d).backward()
    assert torch.equal(xc.grad, xd.grad.cpu())
    for (name, p), q in zip(cpu.named_parameters(), dev.parameters()):
        assert torch.equal(p.grad, q.grad.cpu()), name


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.LSTMCell, torch.nn.GRUCell])
def test_recurrent_forward_under_no_grad(cls) -> None:
    cpu, dev = _pair(cls, 4, 3)
    x = torch.randn(5, 2, 4) if cls in (torch.nn.LSTM, torch.nn.GRU) else torch.randn(2, 4)
    with torch.no_grad():
        a, b = _first(cpu(x)), _first(dev(x.to("neuron")))
    assert b.device.type == "neuron" and not b.requires_grad
    torch.testing.assert_close(b.cpu(), a, rtol=0, atol=1e-6)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
@pytest.mark.parametrize("kwargs", [{}, {"num_layers": 2, "bidirectional": True, "batch_first": True},
                                    {"bias": False}, {"proj_size": 2}])
def test_recurrent_layers_match_cpu(cls, kwargs) -> None:
    """Whole sequences: the CPU projects the input of all steps in one addmm (bias included), torch.nn on
    any other device (CUDA too) multiplies per step and the cell adds the bias, so sums round differently:
    agreement to float32 rounding, not bits (the cells above are bit-identical)."""
    if "proj_size" in kwargs and cls is torch.nn.GRU:
        with pytest.raises(ValueError, match="proj_size argument is only supported for LSTM"):
            cls(6, 5, **kwargs)
        return
    cpu, dev = _pair(cls, 6, 5, **kwargs)
    torch.manual_seed(2)
    x = torch.randn(4, 3, 6)
    out_c, out_d = cpu(x), dev(x.to("neuron"))
    torch.testing.assert_close(out_d[0].cpu(), out_c[0], rtol=1e-5, atol=1e-6)
    _state_loss(out_c).backward()
    _state_loss(out_d).backward()
    for (name, p), q in zip(cpu.named_parameters(), dev.parameters()):
        assert q.grad is not None and q.grad.device.type == "neuron", name
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_lstm_cell_double_backward_matches_cpu() -> None:
    """create_graph=True takes ATen's differentiable cell backward (composite) on the fused path."""
    cpu, dev = _pair(torch.nn.LSTMCell, 3, 2)
    x = torch.randn(2, 3)
    res = []
    for mod, dv in ((cpu, "cpu"), (dev, "neuron")):
        xi = x.to(dv).requires_grad_()
        (g,) = torch.autograd.grad(mod(xi)[0].pow(2).sum(), xi, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), xi)
        res.append((g.cpu(), gg.cpu()))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res[1][1], res[0][1], rtol=1e-5, atol=1e-6)


def test_fused_cell_ops_direct_and_errors() -> None:
    ig, hg, cx = torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 2)
    hy, cy, ws = torch.ops.aten._thnn_fused_lstm_cell(ig.to("neuron"), hg.to("neuron"), cx.to("neuron"))
    gates = (hg + ig).chunk(4, 1)
    i, f, c, o = gates[0].sigmoid(), gates[1].sigmoid(), gates[2].tanh(), gates[3].sigmoid()
    assert torch.equal(cy.cpu(), f * cx + i * c)
    assert torch.equal(hy.cpu(), o * (f * cx + i * c).tanh())
    assert ws.shape == (2, 8) and ws.device.type == "neuron"
    with pytest.raises(RuntimeError, match=r"_thnn_fused_lstm_cell: gates \[2, 6\] do not match state \[2, 2\]"):
        torch.ops.aten._thnn_fused_lstm_cell(torch.randn(2, 6, device="neuron"), torch.randn(2, 6, device="neuron"),
                                             cx.to("neuron"))
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.ops.aten._thnn_fused_gru_cell(ig[:, :6].to("neuron"), hg[:, :6].to("neuron"), cx)


# --------------------------------------------------------------------------- SDPA kernel choice


def _sdp_inputs(requires_grad_mask: bool, **kw):
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    mask = torch.randn(2, 2, 5, 5, requires_grad=requires_grad_mask)
    return q, k, v, mask


@pytest.mark.parametrize("case", ["mask_requires_grad", "mask", "no_mask", "causal", "qkv_requires_grad"])
def test_sdp_choice_equals_cpu(case) -> None:
    q, k, v, mask = _sdp_inputs(case == "mask_requires_grad")
    if case == "qkv_requires_grad":
        q.requires_grad_()
    kwargs = {"attn_mask": mask} if case.startswith("mask") else {}
    kwargs["is_causal"] = case == "causal"
    expected = torch._fused_sdp_choice(q, k, v, **kwargs)
    dev_kwargs = {k_: (v_.detach().to("neuron").requires_grad_(v_.requires_grad) if isinstance(v_, torch.Tensor)
                       else v_) for k_, v_ in kwargs.items()}
    qd = q.detach().to("neuron").requires_grad_(q.requires_grad)
    assert torch._fused_sdp_choice(qd, k.to("neuron"), v.to("neuron"), **dev_kwargs) == expected
    if case == "mask_requires_grad":
        assert expected == 0  # math: flash is not differentiable w.r.t. attn_mask


def test_sdpa_with_mask_requiring_grad_forward_backward() -> None:
    """T5's learned relative position bias: the mask requires grad."""
    q, k, v, mask = _sdp_inputs(True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.pow(2).sum().backward()
    md = mask.detach().to("neuron").requires_grad_()
    out_d = F.scaled_dot_product_attention(q.to("neuron"), k.to("neuron"), v.to("neuron"), attn_mask=md)
    out_d.pow(2).sum().backward()
    assert torch.equal(out_d.cpu(), out)
    assert md.grad is not None and torch.equal(md.grad.cpu(), mask.grad)


# --------------------------------------------------------------------------- dtypes CUDA has, the CPU lacks


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_integer_histc(dtype) -> None:
    x = torch.tensor([0, 1, 1, 3, 3, 3, 7, 9, 12], dtype=dtype)
    got = torch.histc(x.to("neuron"), bins=4, min=0, max=8)
    assert got.dtype == dtype and got.device.type == "neuron"
    # bins of width 2 over [0, 8]: {0,1,1}, {3,3,3}, {}, {7}; 9 and 12 are outside
    assert got.cpu().tolist() == [3, 3, 0, 1]
    out = torch.empty(0, dtype=dtype, device="neuron")
    assert torch.histc(x.to("neuron"), bins=4, min=0, max=8, out=out) is out
    assert out.cpu().tolist() == [3, 3, 0, 1]


def test_integer_histc_like_moe_routing() -> None:
    """Hugging Face MoE: tokens per expert with histc on int64 expert ids (min=0, max=E-1)."""
    torch.manual_seed(4)
    experts = torch.randint(0, 8, (64, 2))
    got = torch.histc(experts.to("neuron"), bins=8, min=0, max=7)
    assert torch.equal(got.cpu(), torch.bincount(experts.flatten(), minlength=8))
    # min == max: the data's range, as for floats
    got = torch.histc(experts.to("neuron"), bins=8)
    assert torch.equal(got.cpu(), torch.histc(experts.double(), bins=8).long())


def test_half_kernels_cuda_has_are_upcast() -> None:
    torch.manual_seed(5)
    x = torch.randn(1, 2, 4, 4, 4)
    for dtype in (torch.float16, torch.bfloat16):
        got = F.avg_pool3d(x.to(dtype).to("neuron"), 2)
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), F.avg_pool3d(x.to(dtype).float(), 2).to(dtype))
        logits, target = torch.randn(4, 5), torch.tensor([0, 3, 4, 1])
        got = F.multi_margin_loss(logits.to(dtype).to("neuron"), target.to("neuron"))
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), F.multi_margin_loss(logits.to(dtype).float(), target).to(dtype))
    xd = x.half().to("neuron").requires_grad_()
    F.avg_pool3d(xd, 2).sum().backward()
    assert xd.grad.dtype == torch.float16 and torch.equal(xd.grad.cpu(), torch.full_like(x, 0.125).half())


def test_other_dtypes_cuda_has() -> None:
    b = torch.tensor([True, False, True])
    assert torch.abs(b.to("neuron")).cpu().tolist() == [True, False, True]
    eye = torch.eye(3, dtype=torch.bool)
    got = torch.trace(eye.to("neuron"))
    assert got.dtype == torch.int64 and got.item() == 3
    z = torch.tensor([1 + 1j, float("nan") + 0j, 2 - 1j], dtype=torch.complex64)
    got = torch.nansum(z.to("neuron"))
    assert got.dtype == torch.complex64 and got.item() == 3 + 0j
    c = torch.tensor([1 + 2j, 0.5 - 1j], dtype=torch.complex32)
    got = torch.exp(c.to("neuron"))
    assert got.dtype == torch.complex32
    expected = torch.exp(c.to(torch.complex64)).to(torch.complex32)
    assert torch.equal(torch.view_as_real(got.cpu()), torch.view_as_real(expected))
    # half FFTs stay unsupported: torch.fft's composite checks `device.is_cuda()` before any kernel runs
    h = torch.arange(8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="^Unsupported dtype Half$"):
        torch.fft.rfft(h.to("neuron"))


# --------------------------------------------------------------------------- out= on another device


@pytest.mark.parametrize("shape", [(), (0,), (3, 2)])
def test_nonzero_out_on_cpu_raises(shape) -> None:
    x = torch.tensor([[1, 0], [2, 3]], device="neuron")
    out = torch.full(shape, -1, dtype=torch.long)
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.nonzero(x, out=out)
    assert out.shape == shape  # untouched


@pytest.mark.parametrize("call", [
    lambda x, o: torch.add(x, x, out=o),
    lambda x, o: torch.amax(x, out=o),
    lambda x, o: torch.sum(x, dim=(0, 1), out=o),
    lambda x, o: torch.masked_select(x, x > 0, out=o),
    lambda x, o: torch.histc(x, out=o),
    lambda x, o: torch.mul(x, 2, out=o),
], ids=["add", "amax", "sum", "masked_select", "histc", "mul_scalar"])
def test_zero_dim_cpu_out_raises_like_cuda(call) -> None:
    """A 0-dim CPU tensor may be *read* as a scalar on an accelerator, never written as out=."""
    x = torch.tensor([[1.0, 0.0], [2.0, 3.0]], device="neuron")
    out = torch.tensor(-1.0)
    with pytest.raises(RuntimeError, match=MISMATCH):
        call(x, out)
    assert out.item() == -1.0
    assert torch.equal(x + torch.tensor(1.0), torch.tensor([[2.0, 1.0], [3.0, 4.0]], device="neuron"))


def test_sdp_choice_under_fake_tensors() -> None:
    """torch.compile traces SDPA with fake neuron tensors: the choice must not dispatch ops on them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 2, 5, 8, device="neuron")
        mask = torch.empty(2, 2, 5, 5, device="neuron", requires_grad=True)
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        choice = torch._fused_sdp_choice(q, q, q, attn_mask=mask)
    assert out.shape == (2, 2, 5, 8) and out.device.type == "neuron"
    assert choice == 0


# --------------------------------------------------------------------------- 0-dim CPU operands, as CUDA's checks

# CUDA registers every op of native_functions.yaml without `device_check: NoCheck` with a check that all its
# positional tensor arguments share one device (a 0-dim CPU tensor included); TensorIterator ops are NoCheck
# and read a 0-dim CPU tensor as a scalar. Every op took 0-dim CPU tensors here.
_X = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
_CHECKED = {
    "index_select": lambda x: torch.index_select(x, 0, torch.tensor(1)),
    "gather": lambda x: torch.gather(x[0], 0, torch.tensor(0)),
    "cross_entropy target": lambda x: F.cross_entropy(x[0], torch.tensor(1)),
    "nll_loss target": lambda x: F.nll_loss(x[0].log_softmax(0), torch.tensor(1)),
    "searchsorted values": lambda x: torch.searchsorted(x[0], torch.tensor(1.5)),
    "clamp min tensor": lambda x: torch.clamp(x, torch.tensor(1.0)),
    "scatter_add index": lambda x: x[0].scatter_add(0, torch.tensor(0), x[0]),
    "embedding weight": lambda x: F.embedding(torch.tensor(1, device=x.device), torch.ones(3, 2)),
}
_SCALAR_OK = {
    "add": (lambda x: x + torch.tensor(2.0), lambda x: x + 2.0),
    "where other": (lambda x: torch.where(x > 1, x, torch.tensor(-1.0)), lambda x: torch.where(x > 1, x, -1.0)),
    "lerp weight": (lambda x: torch.lerp(x, x * 2, torch.tensor(0.5)), lambda x: torch.lerp(x, x * 2, 0.5)),
    "masked_fill value": (lambda x: x.masked_fill(x > 2, torch.tensor(7.0)), lambda x: x.masked_fill(x > 2, 7.0)),
    "index_put values": (lambda x: x.index_put((torch.tensor([0]),), torch.tensor(9.0)),
                         lambda x: x.index_put((torch.tensor([0], device=x.device),), torch.tensor(9.0, device=x.device))),
    "addcmul value": (lambda x: torch.addcmul(x, x, torch.tensor(2.0)), lambda x: torch.addcmul(x, x, x.new_tensor(2.0))),
}


@pytest.mark.parametrize("name", list(_CHECKED))
def test_zero_dim_cpu_operand_of_a_device_checked_op_raises_like_cuda(name: str) -> None:
    x = torch.tensor(_X, device="neuron")
    with pytest.raises(RuntimeError, match=MISMATCH):
        _CHECKED[name](x)


@pytest.mark.parametrize("name", list(_SCALAR_OK))
def test_zero_dim_cpu_operand_of_a_tensor_iterator_op_is_a_scalar(name: str) -> None:
    with_cpu, reference = _SCALAR_OK[name]
    x = torch.tensor(_X, device="neuron")
    got = with_cpu(x)
    assert got.device == x.device
    assert torch.equal(got.cpu(), reference(torch.tensor(_X)))


@pytest.mark.parametrize("mask_shape", [(), (2, 3)])
def test_masked_fill_with_a_cpu_mask_raises_cudas_error(mask_shape: tuple[int, ...]) -> None:
    # CUDA's masked_fill_ (NoCheck) checks its mask's device itself, whatever its dim
    x = torch.tensor(_X, device="neuron")
    with pytest.raises(RuntimeError, match=r"expected self and mask to be on the same device, but got mask on cpu "
                                           r"and self on neuron:0"):
        x.masked_fill_(torch.ones(mask_shape, dtype=torch.bool), 1.0)
    assert x.cpu().tolist() == _X


# --------------------------------------------------------------------------- nested tensors and SDPA


def _jagged(parts: list[torch.Tensor], device: str, grad: bool) -> torch.Tensor:
    return torch.nested.nested_tensor([p.clone() for p in parts], layout=torch.jagged, device=device,
                                      requires_grad=grad)


@pytest.mark.parametrize("grad", [False, True])
def test_sdpa_on_jagged_nested_tensors_matches_cpu(grad: bool) -> None:
    # torch's math path rebuilt the inputs as strided nested tensors: "operator aten::stride does not exist"
    # without grad, an abort (rc 134) with it
    torch.manual_seed(0)
    parts = [torch.randn(n, 2, 8) for n in (3, 5, 2)]
    out = {}
    for dev in ("cpu", "neuron"):
        base = _jagged(parts, dev, grad)
        q = base.transpose(1, 2)
        o = F.scaled_dot_product_attention(q, q * 0.5, q)
        if grad:
            o.values().sum().backward()
        out[dev] = (o, base.grad)
    (oc, gc), (on, gn) = out["cpu"], out["neuron"]
    assert on.is_nested and on.device == torch.device("neuron", 0) and on.shape[:2] == oc.shape[:2]
    assert torch.equal(on.values().cpu(), oc.values())
    if grad:
        assert torch.equal(gn.values().cpu(), gc.values())


def test_sdpa_on_jagged_nested_tensors_refuses_what_cpu_refuses() -> None:
    parts = [torch.randn(n, 2, 8) for n in (3, 5)]
    errors = {}
    for dev in ("cpu", "neuron"):
        q = _jagged(parts, dev, False).transpose(1, 2)
        with pytest.raises(RuntimeError) as e:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        errors[dev] = str(e.value)
    assert errors["neuron"] == errors["cpu"]


def test_a_strided_nested_tensor_of_neuron_tensors_that_require_grad_raises() -> None:
    # autograd read the new nested tensor's sizes through an op that raised inside a constructor: rc 134
    facts = run_child("""
        a = torch.randn(3, 8, device="neuron", requires_grad=True)
        emit({"as_nested": outcome(lambda: torch.nested.as_nested_tensor([a, a]).is_nested),
              "nested": outcome(lambda: torch.nested.nested_tensor([a.detach()]).is_nested),
              "jagged": outcome(lambda: torch.nested.as_nested_tensor([a, a], layout=torch.jagged).is_nested)})
    """, outcomes=True)
    for name in ("as_nested", "nested"):
        assert facts[name]["error"] == "NotImplementedError", facts
        assert "nested (torch.strided layout)" in facts[name]["message"]
    assert facts["jagged"] == {"value": True}


# --------------------------------------------------------------------------- warnings


_RESIZED_OUT = {
    "clamp": lambda a, d: torch.clamp(a, -0.5, 0.5, out=torch.empty(2, 2, device=d)),
    "add": lambda a, d: torch.add(a, a, out=torch.empty(2, 2, device=d)),
    "mm": lambda a, d: torch.mm(a, a, out=torch.empty(2, 2, device=d)),
    "sum": lambda a, d: torch.sum(a, 0, out=torch.empty(2, 2, device=d)),
    "gather": lambda a, d: torch.gather(a, 0, torch.zeros(4, 4, dtype=torch.long, device=d),
                                        out=torch.empty(2, 2, device=d)),
    "topk": lambda a, d: torch.topk(a, 2, out=(torch.empty(1, device=d), torch.empty(1, dtype=torch.long, device=d))),
}


@pytest.mark.parametrize("name", list(_RESIZED_OUT))
def test_an_out_tensor_resized_warns_once_as_on_cpu(name: str) -> None:
    # the plan's Meta kernel warned too (a garbled Python warning from torch/_prims_common, or the C++ one twice)
    import warnings

    got = {}
    for dev in ("cpu", "neuron"):
        a = torch.randn(4, 4, device=dev)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(2):
                _RESIZED_OUT[name](a, dev)
        got[dev] = [(str(x.message).split(".")[0], x.filename) for x in w]
    assert got["neuron"] == got["cpu"]
    assert len(got["cpu"]) >= 2


# --- complex32 and the other upcast dtypes: the result dtype and the checks are the op's own -------------------
with warnings.catch_warnings():  # "ComplexHalf support is experimental"
    warnings.simplefilter("ignore")
    _XC = torch.tensor([0.25 + 1j, -1.5 + 0.5j, 3 - 2j, 40 + 0.125j], dtype=torch.complex64).to(torch.complex32)
_C64 = torch.tensor([1 / 3 + 0j, 1e-4j, 2 + 0j, 1e5 + 0j], dtype=torch.complex64)
_F32 = torch.tensor([3.0, 7.0, 0.1, 1e4])


@pytest.mark.parametrize(
    "name",
    ["div_chalf_f32", "div_c64_chalf", "pow_c64_chalf", "pow_chalf_f32", "logaddexp", "prod_dtype_c64", "sum_dtype_c64",
     "sum_all_dtype_c64"],
)
def test_complex32_promoted_to_a_wider_dtype_runs_as_on_cpu(name: str) -> None:
    # complex32 with a wider operand or `dtype=complex64` computes in complex64 on CPU (and CUDA): the result
    # was narrowed back to complex32 (inf where complex64 holds the value)
    calls = {
        "div_chalf_f32": lambda d: torch.div(_XC.to(d), _F32.to(d)),
        "div_c64_chalf": lambda d: torch.div(_C64.to(d), _XC.to(d)),
        "pow_c64_chalf": lambda d: torch.pow(_C64.to(d), _XC.to(d)),
        "pow_chalf_f32": lambda d: torch.pow(_XC.to(d), _F32.to(d)),
        "logaddexp": lambda d: torch.logaddexp(_XC.to(d), _C64.to(d)),
        "prod_dtype_c64": lambda d: (_XC * 100).to(d).prod(0, dtype=torch.complex64),
        "sum_dtype_c64": lambda d: (_XC * 1000).to(d).sum(0, dtype=torch.complex64),
        "sum_all_dtype_c64": lambda d: (_XC * 1000).to(d).sum(dtype=torch.complex64),
    }
    expected = calls[name]("cpu")
    got = calls[name]("neuron").cpu()
    assert got.dtype == expected.dtype == torch.complex64
    assert torch.equal(got, expected)


@pytest.mark.parametrize("source", ["complex32", "complex64"])
def test_complex32_reductions_with_dtype_complex32_as_cuda(source: str) -> None:
    # CUDA's sum/prod kernels have complex32: computed in complex64 here, narrowed to the asked dtype
    x = (_XC if source == "complex32" else _C64[:3]).to("neuron")
    for op in (torch.sum, torch.prod):
        got = op(x, 0, dtype=torch.complex32)
        assert got.dtype == torch.complex32
        expected = op(x.cpu().to(torch.complex64), 0).to(torch.complex32)
        assert torch.equal(got.cpu().to(torch.complex64), expected.to(torch.complex64))


_CHALF_INPLACE = ["acos_", "acosh_", "asin_", "asinh_", "atan_", "atanh_", "cos_", "cosh_", "sin_", "sinh_", "tan_",
                  "tanh_", "exp_", "log_", "sqrt_", "rsqrt_", "sigmoid_"]


@pytest.mark.parametrize("name", [*_CHALF_INPLACE, "div_", "true_divide_", "pow_scalar_", "pow_tensor_",
                                  "lerp_scalar_", "lerp_tensor_", "c64_div_chalf_"])
def test_complex32_in_place_ops_are_their_functional_forms(name: str) -> None:
    # CUDA's kernels take complex32 in place as out of place: only the functional and out= overloads were
    # upcast ("exp_vml_cpu" not implemented for 'ComplexHalf' from x.exp_())
    def method(n: str) -> Callable[[torch.Tensor], Any]:
        return lambda t: getattr(t, n)()

    pairs: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[torch.Tensor], Any]]] = {
        n: (method(n), getattr(torch, n[:-1])) for n in _CHALF_INPLACE
    }
    pairs.update({
        "div_": (lambda t: t.div_(t + 1), lambda t: torch.div(t, t + 1)),
        "true_divide_": (lambda t: t.true_divide_(t * 2), lambda t: torch.true_divide(t, t * 2)),
        "pow_scalar_": (lambda t: t.pow_(2), lambda t: torch.pow(t, 2)),
        "pow_tensor_": (lambda t: t.pow_(t / 8), lambda t: torch.pow(t, t / 8)),
        "lerp_scalar_": (lambda t: t.lerp_(t * t, 0.5), lambda t: torch.lerp(t, t * t, 0.5)),
        "lerp_tensor_": (lambda t: t.lerp_(t * t, torch.full_like(t, 0.25)),
                         lambda t: torch.lerp(t, t * t, torch.full_like(t, 0.25))),
        # a complex64 self: computed in complex64, as on CPU
        "c64_div_chalf_": (lambda t: t.div_(_XC.to(t.device)), lambda t: torch.div(t, _XC.to(t.device))),
    })
    in_place, functional = pairs[name]
    src = _C64 if name.startswith("c64") else _XC
    x = src.to("neuron")
    ptr = x.data_ptr()
    out = in_place(x)
    assert out is x and x.data_ptr() == ptr and x.dtype == src.dtype
    expected = functional(src.to("neuron") if src is _XC else src).cpu()
    assert expected.dtype == src.dtype
    assert torch.equal(x.cpu().to(torch.complex64), expected.to(torch.complex64))  # no CPU equal for complex32


@pytest.mark.parametrize("name", ["exp_out_c64", "sin_out_c128", "div_out_c64", "angle_out_f32", "angle_out_f64",
                                  "div_c64_out_c64", "sum_out_c64"])
def test_complex32_with_a_wider_out_is_computed_in_complex32_and_cast(name: str) -> None:
    # CUDA computes in the inputs' dtype (complex32) and casts into a wider out=: the CPU kernel ran un-widened
    # ("exp_vml_cpu" not implemented for 'ComplexHalf'), and angle's float out missed complex32's rounding
    calls = {
        "exp_out_c64": (lambda d, o: torch.exp(_XC.to(d), out=o), torch.complex64,
                        lambda: torch.exp(_XC.to(torch.complex64)).to(torch.complex32)),
        "sin_out_c128": (lambda d, o: torch.sin(_XC.to(d), out=o), torch.complex128,
                         lambda: torch.sin(_XC.to(torch.complex64)).to(torch.complex32)),
        "div_out_c64": (lambda d, o: torch.div(_XC.to(d), (_XC * 2).to(d), out=o), torch.complex64,
                        lambda: torch.div(_XC.to(torch.complex64), (_XC * 2).to(torch.complex64)).to(torch.complex32)),
        "angle_out_f32": (lambda d, o: torch.angle(_XC.to(d), out=o), torch.float32,
                          lambda: torch.angle(_XC.to(torch.complex64)).half()),
        "angle_out_f64": (lambda d, o: torch.angle(_XC.to(d), out=o), torch.float64,
                          lambda: torch.angle(_XC.to(torch.complex64)).half()),
        # a complex64 operand: computed in complex64, as on CPU
        "div_c64_out_c64": (lambda d, o: torch.div(_XC.to(d), _C64.to(d), out=o), torch.complex64,
                            lambda: torch.div(_XC, _C64)),
        # a reduction computes in its out='s dtype, as on CPU
        "sum_out_c64": (lambda d, o: torch.sum(_XC.to(d), 0, out=o), torch.complex64,
                        lambda: torch.sum(_XC, 0, out=torch.empty((), dtype=torch.complex64))),
    }
    call, dtype, reference = calls[name]
    out = torch.empty(0, dtype=dtype, device="neuron")
    got = call("neuron", out)
    assert got is out and out.dtype == dtype
    assert torch.equal(out.cpu(), reference().to(dtype))


def _error(fn) -> tuple[str, str]:
    with pytest.raises(Exception) as info:
        fn()
        torch.neuron.synchronize()
    return type(info.value).__name__, str(info.value).split(" (while running")[0].splitlines()[0]


@pytest.mark.parametrize(
    "name",
    ["lerp_chalf_c64", "abs_bool_out_uint8", "abs_uint8_out_bool", "abs_bool_out_float", "avg_pool3d_half_out_float",
     "sub_byte_strided_copy"],
)
def test_upcast_ops_refuse_what_cpu_and_cuda_refuse_with_cpus_error(name: str) -> None:
    # the widened arguments passed the op's own checks (lerp's dtype of `end`, out= dtypes): results came back
    # in the wrong dtype, or the widened dtype showed in the error
    calls = {
        "lerp_chalf_c64": lambda d: torch.lerp(_XC.to(d), _C64.to(d), 0.5),
        "abs_bool_out_uint8": lambda d: torch.abs(
            torch.tensor([True, False], device=d), out=torch.empty(2, dtype=torch.uint8, device=d)),
        "abs_uint8_out_bool": lambda d: torch.abs(
            torch.tensor([2, 0], dtype=torch.uint8, device=d), out=torch.empty(2, dtype=torch.bool, device=d)),
        "abs_bool_out_float": lambda d: torch.abs(torch.tensor([True, False], device=d), out=torch.empty(2, device=d)),
        "avg_pool3d_half_out_float": lambda d: torch._C._nn.avg_pool3d(
            torch.ones(1, 1, 2, 2, 2, dtype=torch.half, device=d), 2, out=torch.empty(1, 1, 1, 1, 1, device=d)),
        "sub_byte_strided_copy": lambda d: torch.arange(8, dtype=torch.uint8, device=d).view(torch.uint4)[::2].clone(),
    }
    assert _error(lambda: calls[name]("neuron")) == _error(lambda: calls[name]("cpu"))
    assert torch.ones(2, device="neuron").add(1).cpu().tolist() == [2.0, 2.0]  # the device stays usable


def test_integer_histc_into_another_out_dtype_and_bounds_of_the_inputs_type_as_cuda() -> None:
    # CUDA's histc copies its result into any out= dtype, and takes min/max as values of the input's type
    x = torch.arange(5, dtype=torch.int8, device="neuron")
    out = torch.empty(3, device="neuron")
    assert torch.histc(x, 3, 0, 4, out=out) is out
    assert out.dtype == torch.float32 and out.cpu().tolist() == [2.0, 1.0, 2.0]
    u8 = torch.arange(5, dtype=torch.uint8, device="neuron")
    with pytest.raises(RuntimeError, match="max must be larger than min"):  # min=-1 is 255 in uint8
        torch.histc(u8, 3, -1, 4)


@pytest.mark.parametrize("dtype", [torch.uint4, torch.int4, torch.uint1, torch.int7])
def test_sub_byte_dtypes_copy_between_host_and_device_as_bytes(dtype: torch.dtype) -> None:
    # CUDA copies same-dtype contiguous tensors with a memcpy; the CPU has no copy kernel for these dtypes
    raw = torch.arange(16, dtype=torch.uint8).reshape(4, 4)
    dev = raw.view(dtype).to("neuron")
    assert dev.dtype == dtype and dev.device.type == "neuron"
    back = dev.clone().cpu()
    assert torch.equal(back.view(torch.uint8), raw)
    host = torch.empty(4, 4, dtype=torch.uint8).pin_memory().view(dtype)
    host.copy_(dev, non_blocking=True)
    torch.neuron.synchronize()
    assert torch.equal(host.view(torch.uint8), raw)
