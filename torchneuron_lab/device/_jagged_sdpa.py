"""Scaled dot-product attention on jagged nested tensors on ``neuron``.

torch runs SDPA on jagged nested tensors (``torch.nested.nested_tensor(parts, layout=torch.jagged)``) with
CUDA's fused varlen kernels on CUDA, and elsewhere with its math path, which first rebuilds the inputs as
*strided* nested tensors (``torch/nested/_internal/sdpa.py``, ``get_strided_layout_nested_tensor``). The emulated
device holds no strided nested tensors, so that path raised the lab's layout error, which NestedTensor's
``__torch_function__`` swallowed before retrying the op natively: ``RuntimeError: operator aten::stride does
not exist``. With grad, the same path aborted the interpreter (rc 134) until the layout error was raised at the
nested tensor's construction.

On neuron the math path is composed here from the same math kernel run on each sequence's dense
``(heads, length, dim)`` slices, which is what the math kernel does to each member of a strided nested tensor;
the result is a jagged view over the concatenated outputs, as torch's path returns. Autograd flows through the
slices. Cases torch's path does not send to its math branch (masks, ``is_causal``, inputs that are not contiguous
after the transpose, math disabled by ``sdpa_kernel``) go to torch's function unchanged, so they raise what it
raises.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def _neuron_jagged_math(query: Any, key: Any, value: Any, dropout_p: float, scale: float | None,
                        enable_gqa: bool) -> Any:
    from torch.nested._internal.nested_tensor import nested_view_from_values_offsets_lengths

    offsets = query.offsets()
    q_lengths = query.lengths()
    min_seqlen = query._maybe_min_seqlen
    max_seqlen = query._maybe_max_seqlen

    def per_sequence(nt: Any) -> list[torch.Tensor]:
        # (B, heads, j, dim) jagged -> its values (total, heads, dim) split by sequence, each (heads, len, dim)
        lengths = (nt._offsets[1:] - nt._offsets[:-1]).tolist()
        return [t.transpose(0, 1) for t in nt.transpose(1, 2).values().split(lengths, dim=0)]

    outs = [
        torch._scaled_dot_product_attention_math(q, k, v, None, dropout_p, False, scale=scale,
                                                 enable_gqa=enable_gqa)[0]
        for q, k, v in zip(per_sequence(query), per_sequence(key), per_sequence(value), strict=True)
    ]
    values = torch.cat([o.transpose(0, 1) for o in outs], dim=0)  # (total, heads, dim_v)
    return nested_view_from_values_offsets_lengths(
        values, offsets, lengths=q_lengths, min_seqlen=min_seqlen, max_seqlen=max_seqlen
    ).transpose(1, 2)


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def jagged_scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                            dropout_p: float = 0.0, is_causal: bool = False,
                                            scale: float | None = None, enable_gqa: bool = False) -> Any:
        from torch.backends.cuda import math_sdp_enabled
        from torch.nested._internal import sdpa
        from torch.nested._internal.nested_tensor import NestedTensor

        on_neuron = isinstance(query, NestedTensor) and query.device.type == "neuron"
        dense_path = query.dim() > 3 and key.dim() > 3 and value.dim() > 3 and query._ragged_idx == 1
        if not on_neuron or dense_path or attn_mask is not None or is_causal or not math_sdp_enabled():
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        query, key, value, attn_mask = sdpa._autocast(query, key, value, attn_mask)
        sdpa._validate_sdpa_input(query, key, value, attn_mask, dropout_p, is_causal, scale)
        if not all(t.transpose(1, 2).is_contiguous() for t in (query, key, value)):
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return _neuron_jagged_math(query, key, value, dropout_p, scale, enable_gqa)

    jagged_scaled_dot_product_attention._torchneuron_lab = True  # type: ignore[attr-defined]
    return jagged_scaled_dot_product_attention


def install() -> None:
    """Route jagged SDPA on neuron through the composition above (idempotent)."""
    from torch.nested._internal import ops, sdpa

    for module in (sdpa, ops):
        fn = getattr(module, "jagged_scaled_dot_product_attention", None)
        if fn is not None and not getattr(fn, "_torchneuron_lab", False):
            setattr(module, "jagged_scaled_dot_product_attention", _wrap(fn))  # noqa: B010
