"""Compiled code computes what eager ``neuron`` computes for the ops CUDA has and the CPU lacks.

Eager ``neuron`` runs those ops through ``device/csrc/cuda_parity.cpp`` (see the "CUDA parity" table of
``device/csrc/README.md``): integer ``histc``, half/bfloat16 pooling and losses, bool ``abs``/``trace``,
complex32 elementwise ops and reductions are *upcast* (arguments widened, the CPU kernel runs, results
narrowed back); torch.nn's fused LSTM/GRU cells (which ATen picks on every non-CPU device) are
*composed* in the CPU's unfused order. A compiled graph is retargeted to the CPU before Inductor lowers
it (``backend._inner_compile``), so those ops would reach CPU code that rejects them.

This module gives AOTAutograd (which traces on fake *neuron* tensors, before the retargeting) one
decomposition per such op that spells out what the device kernel does: ``histc(int)`` becomes
``histc(x.double(), min=trunc(min), max=trunc(max)).to(int)``, ``_thnn_fused_lstm_cell`` becomes the
cell's ATen ops, and so on. Inductor then compiles the same program as eager ``neuron`` runs, with
CPU-supported dtypes only. For inputs the device does not upcast, the op keeps Inductor's own
decomposition (or none).

The set of ops is the device's: :func:`device_parity_ops` lists the ops whose ``neuron`` kernel is
registered in ``cuda_parity.cpp`` (read from the dispatcher), and ``tests/test_compile_cuda_parity.py``
checks that each has a rule here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

__all__ = ["RULES", "decompositions", "device_parity_ops"]

_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_HALFS = (torch.float16, torch.bfloat16)


class _Upcast:
    """Arguments of a dtype in ``src`` are widened to ``dst`` (complex to its complex counterpart)."""

    def __init__(self, src: tuple[torch.dtype, ...], dst: torch.dtype, narrow: bool = True) -> None:
        self.src, self.dst, self.narrow = src, dst, narrow

    def widen(self, dtype: torch.dtype) -> torch.dtype:
        if dtype not in self.src:
            return dtype
        return self.dst.to_complex() if dtype.is_complex and not self.dst.is_complex else self.dst


_RULE_INTS = _Upcast(_INTS, torch.float64)
_RULE_HALFS = _Upcast(_HALFS, torch.float32)
_RULE_HALF_ONLY = _Upcast((torch.float16,), torch.float32)
_RULE_CHALF = _Upcast((torch.complex32,), torch.complex64)

# op packet name -> rule: the functional overloads of cuda_parity.cpp's upcast table (AOTAutograd's
# graphs are functional: out= and in-place variants arrive as these).
RULES: dict[str, _Upcast] = {
    "histc": _RULE_INTS,
    **dict.fromkeys(["avg_pool3d", "avg_pool3d_backward", "_upsample_bilinear2d_aa",
                     "_upsample_bilinear2d_aa_backward", "multi_margin_loss", "multi_margin_loss_backward",
                     "multilabel_margin_loss_forward", "multilabel_margin_loss_backward"], _RULE_HALFS),
    "rrelu_with_noise": _RULE_HALF_ONLY,
    "rrelu_with_noise_functional": _RULE_HALF_ONLY,
    "abs": _Upcast((torch.bool,), torch.uint8),
    "trace": _Upcast((torch.bool,), torch.uint8, narrow=False),
    **dict.fromkeys(["acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin", "sinh",
                     "tan", "tanh", "exp", "log", "sqrt", "rsqrt", "sigmoid", "angle", "div", "logaddexp",
                     "pow", "lerp", "sum", "prod"], _RULE_CHALF),
}
# composed (not upcast) on the device: the fused recurrent cells and complex nansum
COMPOSED = ("_thnn_fused_lstm_cell", "_thnn_fused_lstm_cell_backward_impl", "_thnn_fused_gru_cell",
            "_thnn_fused_gru_cell_backward", "nansum")


def device_parity_ops() -> list[str]:
    """``aten::`` names (with overload) whose ``neuron`` kernel is registered in cuda_parity.cpp."""
    from ..device import register

    register()
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        for line in torch._C._dispatch_dump(name).splitlines():
            if line.startswith("PrivateUse1:") and "cuda_parity.cpp" in line:
                found.append(name)
                break
    return sorted(found)


def _narrow_to(result: torch.dtype, widened: torch.dtype, original: torch.dtype) -> torch.dtype:
    """The dtype a widened result goes back to (cuda_parity.cpp's ``narrow_to``)."""
    if result == widened:
        return original
    if widened.is_complex and result == widened.to_real() and original.is_complex:
        return original.to_real()
    if not widened.is_complex and result == widened.to_complex() and original == torch.float16:
        return torch.complex32
    return result


def _upcast(op: Any, rule: _Upcast, prev: Callable[..., Any] | None) -> Callable[..., Any]:
    is_histc = op.name() == "aten::histc"

    def decomp(*args: Any, **kwargs: Any) -> Any:
        flat = [*args, *kwargs.values()]
        original = next((a.dtype for a in flat
                         if isinstance(a, torch.Tensor) and rule.widen(a.dtype) != a.dtype), None)
        if original is None:  # not a dtype the device upcasts: Inductor's own treatment
            return prev(*args, **kwargs) if prev is not None else NotImplemented
        widened = rule.widen(original)
        if is_histc and not original.is_floating_point:  # CUDA takes min and max as integers
            args, kwargs = _histc_int_bounds(op, args, kwargs)

        def up(a: Any) -> Any:
            return a.to(rule.widen(a.dtype)) if isinstance(a, torch.Tensor) else a

        # the widened op; Inductor treats it as it treats that op on the CPU (its own decomposition if it
        # has one: an op in Inductor's table cannot stay in the graph as a fallback)
        out = op(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
        if not rule.narrow:
            return out

        def down(r: Any) -> Any:
            if not isinstance(r, torch.Tensor):
                return r
            back = _narrow_to(r.dtype, widened, original)
            return r.to(back) if back != r.dtype else r

        return tuple(down(r) for r in out) if isinstance(out, (tuple, list)) else down(out)

    return decomp


def _histc_int_bounds(op: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    names = [a.name for a in op._schema.arguments]
    args = tuple(float(int(a)) if i < len(names) and names[i] in ("min", "max") else a
                 for i, a in enumerate(args))
    kwargs = {k: float(int(v)) if k in ("min", "max") else v for k, v in kwargs.items()}
    return args, kwargs


# --------------------------------------------------------------------------- fused recurrent cells
# The same ATen ops in the same order as cuda_parity.cpp's fused_lstm_cell / fused_gru_cell and their
# backwards (the CPU's unfused cell), so compiled cells round as eager ones do.


def _bias(gates: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gates + bias if bias is not None else gates


def _lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
               input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None) -> Any:
    gates = _bias(hidden_gates, hidden_bias) + _bias(input_gates, input_bias)
    i, f, c, o = gates.chunk(4, 1)
    i, f, c, o = i.sigmoid(), f.sigmoid(), c.tanh(), o.sigmoid()
    cy = f * cx + i * c
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, c, o], 1)


def _lstm_cell_backward(grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None, cx: torch.Tensor,
                        cy: torch.Tensor, workspace: torch.Tensor, has_bias: bool) -> Any:
    if grad_hy is None and grad_cy is None:
        return None, None, None
    ig, fg, cg, og = workspace.chunk(4, 1)
    if grad_hy is not None:
        tanh_cy = cy.tanh()
        grad_og = grad_hy * tanh_cy
        gcy = aten.tanh_backward(grad_hy * og, tanh_cy)
        if grad_cy is not None:
            gcy = gcy + grad_cy
    else:
        grad_og = torch.zeros_like(og)
        gcy = grad_cy
    grad_gates = torch.cat([aten.sigmoid_backward(gcy * cg, ig), aten.sigmoid_backward(gcy * cx, fg),
                            aten.tanh_backward(gcy * ig, cg), aten.sigmoid_backward(grad_og, og)], 1)
    return grad_gates, gcy * fg, grad_gates.sum(0) if has_bias else None


def _gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
              input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None) -> Any:
    ig = _bias(input_gates, input_bias).chunk(3, 1)
    hg = _bias(hidden_gates, hidden_bias).chunk(3, 1)
    r = (hg[0] + ig[0]).sigmoid()
    z = (hg[1] + ig[1]).sigmoid()
    n = (ig[2] + hg[2] * r).tanh()
    hy = (hx - n) * z + n
    return hy, torch.cat([r, z, n, hg[2], hx], 1)


def _gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool) -> Any:
    r, z, n, hn, hx = workspace.chunk(5, 1)
    grad_d = grad_hy * z
    grad_z = grad_hy * (hx - n)
    grad_n = grad_hy + grad_d.neg()
    grad_s = aten.tanh_backward(grad_n, n)
    grad_r = aten.sigmoid_backward(grad_s * hn, r)
    grad_zp = aten.sigmoid_backward(grad_z, z)
    grad_hn = grad_s * r
    gi = torch.cat([grad_r, grad_zp, grad_s], 1)
    gh = torch.cat([grad_r, grad_zp, grad_hn], 1)
    return gi, gh, grad_d, gi.sum(0) if has_bias else None, gh.sum(0) if has_bias else None


def _nansum(prev: Callable[..., Any] | None) -> Callable[..., Any]:
    def decomp(self: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
        if not self.dtype.is_complex:
            return prev(self, dim, keepdim, dtype=dtype) if prev is not None else NotImplemented
        zeroed = torch.where(torch.isnan(self), torch.zeros((), dtype=self.dtype, device=self.device), self)
        return aten.sum.dim_IntList(zeroed, dim, keepdim, dtype=dtype)

    return decomp


@functools.lru_cache(maxsize=1)
def _ours() -> tuple[tuple[Any, Callable[..., Any] | None], ...]:
    """(overload, builder) pairs; builders take Inductor's decomposition of the overload (or None)."""
    pairs: list[tuple[Any, Any]] = []
    for name, rule in RULES.items():
        packet = getattr(aten, name)
        for ov in packet.overloads():
            overload = getattr(packet, ov)
            if any(a.is_out for a in overload._schema.arguments) or overload._schema.is_mutable:
                continue  # functional graphs never hold these
            pairs.append((overload, functools.partial(_upcast, overload, rule)))
    fixed = {aten._thnn_fused_lstm_cell.default: _lstm_cell,
             aten._thnn_fused_lstm_cell_backward_impl.default: _lstm_cell_backward,
             aten._thnn_fused_gru_cell.default: _gru_cell,
             aten._thnn_fused_gru_cell_backward.default: _gru_cell_backward}
    pairs += [(op, functools.partial(lambda f, prev: f, f)) for op, f in fixed.items()]
    pairs.append((aten.nansum.default, _nansum))
    return tuple(pairs)


def decompositions(base: dict[Any, Callable[..., Any]]) -> dict[Any, Callable[..., Any]]:
    """``base`` (Inductor's decomposition table) with the device's CUDA-parity ops spelled out."""
    table = dict(base)
    for op, build in _ours():
        table[op] = build(base.get(op))
    return table
