"""``flex_attention`` on neuron tensors.

torch 2.13's ``torch.nn.attention.flex_attention`` refuses any device outside a fixed set ("FlexAttention is
only supported on CUDA, CPU, HPU, or MPS devices"), in eager and under Dynamo, which traces the same check.
On CUDA flex attention runs forward and backward, eager and compiled. Here:

- **eager** (forward and backward): the check lets neuron through, and flex attention's own eager path runs
  (its math implementation, the one CUDA's eager path also runs): the forward is CPU's, bit for bit. CPU's
  refusal of eager backward is a CPU limit, not a device rule, and is kept for CPU tensors only.
- **compiled** (``backend="neuron"`` or the default backend): Inductor lowers a neuron graph with its CPU
  code generation, whose flex template is inference-only (no logsumexp output, no backward). A flex call that
  needs the logsumexp (grad mode on: a training graph) is traced through flex attention's math
  implementation instead (:func:`math_for_training`), so AOTAutograd and Inductor compile ordinary ATen ops
  forward and backward; under ``torch.no_grad()`` the fused CPU template runs, as Inductor on CPU tensors.
"""

from __future__ import annotations

import functools
from typing import Any

_MARK = "_torchneuron_lab_neuron_ok"


def install() -> None:
    """Let neuron tensors through flex attention's device check (idempotent)."""
    import torch.nn.attention.flex_attention as fa

    check = getattr(fa, "_validate_device", None)
    if check is None or getattr(check, _MARK, False):
        return

    @functools.wraps(check)
    def _validate_device(query: Any, key: Any, value: Any) -> None:
        if query.device.type == "neuron":
            return
        check(query, key, value)

    setattr(_validate_device, _MARK, True)
    fa._validate_device = _validate_device


def _math(*args: Any) -> Any:
    from torch._higher_order_ops.flex_attention import sdpa_dense

    return sdpa_dense(*args)


def math_for_training(gm: Any) -> int:
    """Point each flex attention call of a Dynamo graph that must return its logsumexp at flex attention's math
    implementation (Inductor's CPU template cannot lower it). Returns how many calls were rewritten."""
    try:
        from torch._higher_order_ops.flex_attention import flex_attention as hop
    except ImportError:  # pragma: no cover - torch without flex attention
        return 0
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not hop or len(node.args) < 7:
            continue
        options = node.args[6]
        if isinstance(options, dict) and options.get("OUTPUT_LOGSUMEXP"):
            node.target = _math
            n += 1
    if n:
        gm.recompile()
    return n
