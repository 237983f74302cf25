"""Compiled code on neuron computes what eager neuron computes for the ops CUDA has and the CPU lacks.

Eager neuron upcasts or composes those ops (device/csrc/cuda_parity.cpp); a compiled graph is lowered for
the CPU, so without ``compiler/cuda_parity.py`` each of them failed to compile or to run (Mixtral's
integer ``histc``: ``"histogram_cpu" not implemented for 'Int'``; complex32 ``exp``: ``"exp_vml_cpu" not
implemented for 'ComplexHalf'``; ``LSTMCell``: no CPU kernel for ``_thnn_fused_lstm_cell``; bool ``abs``:
a C++ compile error; antialiased half upsampling: ``not implemented for 'Half'``).

Each case compares outputs (and gradients of floating inputs) of ``torch.compile(backend="neuron")`` with
eager neuron, bit for bit. Where Inductor itself changes the numerics of the CPU-equivalent program
(fusing the recurrent cells' elementwise ops; its decomposition of ``multilabel_margin_loss``), the
compiled result equals Inductor-CPU's on that program instead, bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torchneuron_lab.compiler  # noqa: F401  (registers backend="neuron")
from torchneuron_lab.compiler import cuda_parity

D = "neuron"


def _as_list(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else [o for o in out if isinstance(o, torch.Tensor)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return torch.view_as_real(t) if t.is_complex() else t


def _run(fn: Callable[..., Any], args: list[torch.Tensor], backend: str | None) -> list[torch.Tensor]:
    """Outputs, then the gradients of the floating inputs (loss: sum of the floating outputs, as float)."""
    torch._dynamo.reset()
    args = [a.detach().clone().requires_grad_() if a.is_floating_point() else a.clone() for a in args]
    f = torch.compile(fn, backend=backend) if backend else fn
    outs = _as_list(f(*args))
    grads: list[torch.Tensor] = []
    if any(a.requires_grad for a in args):
        sum(o.float().sum() * (i + 1) for i, o in enumerate(outs) if o.requires_grad).backward()
        grads = [a.grad for a in args if a.requires_grad]
    torch._dynamo.reset()
    return outs + grads


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(_bits(g), _bits(w)), (g, w)


HIST = [0, 1, 1, 3, 3, 3, 7, 9, 12]
ML_TARGET = [[0, 3, -1, 0, 0], [1, -1, 0, 0, 0], [4, 2, 1, -1, 0], [2, -1, 0, 0, 0]]


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7)).to(dtype)


def _c32() -> torch.Tensor:
    return torch.tensor([1 + 2j, 0.5 - 1j, -0.25 + 0.75j], dtype=torch.complex64).to(torch.complex32)


# (id, function, inputs on CPU) - compiled on neuron == eager on neuron, bit for bit
EAGER_CASES: list[tuple[str, Callable[..., Any], Callable[[], list[torch.Tensor]]]] = [
    *[(f"histc_{dt}", lambda x: torch.histc(x, bins=4, min=0.5, max=8.7),  # CUDA truncates min/max to ints
       lambda dt=dt: [torch.tensor(HIST, dtype=getattr(torch, dt))])
      for dt in ("uint8", "int8", "int16", "int32", "int64")],
    ("histc_int_moe_routing", lambda e: torch.histc(e.reshape(-1).int(), bins=8, min=0, max=7),
     lambda: [torch.randint(0, 8, (16, 2), generator=torch.Generator().manual_seed(3))]),
    *[(f"{op}_{dt}", fn, lambda dt=dt, mk=mk: mk(getattr(torch, dt)))
      for dt in ("float16", "bfloat16")
      for op, fn, mk in [
          ("avg_pool3d", lambda x: F.avg_pool3d(x, 2), lambda d: [_randn(1, 2, 4, 4, 4, dtype=d)]),
          ("upsample_bilinear2d_aa",
           lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", antialias=True),
           lambda d: [_randn(1, 2, 4, 4, dtype=d)]),
          ("multi_margin_loss", lambda x, t: F.multi_margin_loss(x, t),
           lambda d: [_randn(4, 5, dtype=d), torch.tensor([0, 3, 4, 1])]),
      ]],
    ("rrelu_eval_float16", lambda x: F.rrelu(x, training=False), lambda: [_randn(8, dtype=torch.float16)]),
    ("abs_bool", torch.abs, lambda: [torch.tensor([True, False, True])]),
    ("trace_bool", torch.trace, lambda: [torch.eye(3, dtype=torch.bool)]),
    ("nansum_complex64", torch.nansum, lambda: [torch.tensor([1 + 1j, float("nan") + 0j, 2 - 1j])]),
    ("nanmean_complex64", torch.nanmean, lambda: [torch.tensor([1 + 1j, float("nan") + 0j, 2 - 1j])]),
    *[(f"complex32_{op}", getattr(torch, op), lambda: [_c32()])
      for op in ("acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin", "sinh", "tan",
                 "tanh", "exp", "log", "sqrt", "rsqrt", "sigmoid", "angle")],
    ("complex32_div", lambda a: a / (a + 1), lambda: [_c32()]),
    ("complex32_pow_scalar", lambda a: a**2, lambda: [_c32()]),
    ("complex32_pow_tensor", lambda a: torch.pow(a, a), lambda: [_c32()]),
    ("complex32_lerp", lambda a: torch.lerp(a, a * a, 0.5), lambda: [_c32()]),
    ("complex32_logaddexp", lambda a: torch.logaddexp(a, a * a), lambda: [_c32()]),
    ("complex32_sum", lambda a: a.sum(), lambda: [_c32()]),
    ("complex32_sum_dim", lambda a: a.reshape(3, 1).sum(0), lambda: [_c32()]),
    ("complex32_prod", lambda a: a.prod(), lambda: [_c32()]),
]


@pytest.mark.parametrize("fn,make", [c[1:] for c in EAGER_CASES], ids=[c[0] for c in EAGER_CASES])
def test_compiled_equals_eager_neuron(fn: Callable[..., Any], make: Callable[[], list[torch.Tensor]]) -> None:
    args = [a.to(D) for a in make()]
    eager = _run(fn, args, None)
    compiled = _run(fn, args, "neuron")
    assert all(t.device.type == D for t in compiled)
    _same(compiled, eager)


def test_histc_integer_bounds_are_truncated_as_on_cuda() -> None:
    x = torch.tensor(HIST, dtype=torch.int32, device=D)
    f = torch.compile(lambda x: torch.histc(x, bins=4, min=0.5, max=8.7), backend="neuron")
    got = f(x)
    torch._dynamo.reset()
    # min 0, max 8: bins [0,2) [2,4) [4,6) [6,8]; 9 and 12 fall outside
    assert got.dtype == torch.int32 and got.cpu().tolist() == [3, 3, 0, 1]


def _cells(cls: type) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    cpu = cls(6, 5)
    return cpu, copy.deepcopy(cpu).to(D)


# (id, neuron function, its CPU-equivalent program, inputs on CPU): Inductor changes these programs'
# numerics on the CPU as well; compiled neuron == Inductor-CPU on the CPU-equivalent program, bit for bit
_LSTM, _LSTM_D = _cells(torch.nn.LSTMCell)
_GRU, _GRU_D = _cells(torch.nn.GRUCell)
INDUCTOR_CASES: list[tuple[str, Callable[..., Any], Callable[..., Any], Callable[[], list[torch.Tensor]]]] = [
    ("lstm_cell", lambda x, h, c: _LSTM_D(x, (h, c)), lambda x, h, c: _LSTM(x, (h, c)),
     lambda: [_randn(3, 6), _randn(3, 5) * 0.5, _randn(3, 5) * 0.25]),
    ("gru_cell", lambda x, h: _GRU_D(x, h), lambda x, h: _GRU(x, h),
     lambda: [_randn(3, 6), _randn(3, 5) * 0.5]),
    # decomposed by PyTorch at the Autograd key (a Python kernel) before any device kernel: Inductor's
    # program, in half precision, on both devices (and pytorch/pytorch#141017: that decomposition counts
    # targets after the -1 terminator, so it differs from eager on CPU too)
    *[(f"multilabel_margin_loss_{dt}", lambda x, t: F.multilabel_margin_loss(x, t),
       lambda x, t: F.multilabel_margin_loss(x, t),
       lambda dt=dt: [_randn(4, 5, dtype=getattr(torch, dt)), torch.tensor(ML_TARGET)])
      for dt in ("float16", "bfloat16")],
]


@pytest.mark.parametrize("fn,cpu_fn,make", [c[1:] for c in INDUCTOR_CASES],
                         ids=[c[0] for c in INDUCTOR_CASES])
def test_compiled_equals_inductor_cpu_on_the_cpu_program(fn: Callable[..., Any], cpu_fn: Callable[..., Any],
                                                          make: Callable[[], list[torch.Tensor]]) -> None:
    args = make()
    compiled = _run(fn, [a.to(D) for a in args], "neuron")
    assert all(t.device.type == D for t in compiled)
    want = _run(cpu_fn, [a.clone() for a in args], "inductor")
    _same(compiled, want)


def test_every_op_the_device_upcasts_or_composes_has_a_compiled_rule() -> None:
    """The op set is read from the dispatcher (kernels registered in cuda_parity.cpp), so a new eager
    parity kernel without a compiled twin fails here."""
    ops = cuda_parity.device_parity_ops()
    assert "aten::histc" in ops and "aten::_thnn_fused_lstm_cell" in ops and len(ops) >= 60
    covered = set(cuda_parity.RULES) | set(cuda_parity.COMPOSED)
    # in-place variants (rrelu_with_noise_) reach compiled graphs as their functional op
    missing = sorted({n.split("::")[1].split(".")[0].rstrip("_") or n for n in ops} - covered)
    assert missing == []
