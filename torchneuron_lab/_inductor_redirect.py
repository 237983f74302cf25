"""``torch.compile``'s default backend on neuron graphs.

``torch.compile(model)`` means ``backend="inductor"``, and Inductor generates code only for devices it has
backends for: a graph on neuron tensors failed with ``InductorError: KeyError: 'neuron'`` (what a user types
first; CUDA's default works). Inductor's ``torch.compile`` wrapper (``torch._TorchCompileInductorWrapper``,
which holds the ``mode=``/``options=`` config) hands a graph that computes on neuron -- inputs, parameters or
buffers on neuron, or a node whose value is a neuron tensor (a factory with ``device="neuron"``, a CPU input
moved to neuron, flex attention's ``create_block_mask(..., device="neuron", _compile=True)``) -- to the lab's
backend instead -- Inductor's own ``compile_fx`` pipeline with the emulated device's
runtime around it, the same as ``backend="neuron"`` with that config. Graphs on other devices go to Inductor
unchanged. Installed when the device is registered (no import of Dynamo or Inductor here).
"""

from __future__ import annotations

from typing import Any

_MARK = "_torchneuron_lab_redirect"


def _on_neuron(model: Any, inputs: Any) -> bool:
    import torch

    def neuron(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == "neuron"

    if any(neuron(x) for x in inputs):
        return True
    if isinstance(model, torch.nn.Module) and (
        any(neuron(p) for p in model.parameters()) or any(neuron(b) for b in model.buffers())
    ):
        return True
    graph = getattr(model, "graph", None)
    if isinstance(graph, torch.fx.Graph):
        # Dynamo's nodes carry their (fake) values: any neuron value means Inductor would lower for neuron
        from torch.utils._pytree import tree_leaves

        for node in graph.nodes:
            for key in ("example_value", "val"):
                if any(neuron(v) for v in tree_leaves(node.meta.get(key))):
                    return True
    return False


def install() -> None:
    """Wrap ``torch._TorchCompileInductorWrapper.__call__`` once (idempotent)."""
    import torch

    cls = getattr(torch, "_TorchCompileInductorWrapper", None)
    if cls is None or getattr(cls.__call__, _MARK, False):
        return
    inductor_call = cls.__call__

    def __call__(self: Any, model_: Any, inputs_: Any, *, config_patches: dict[str, Any] | None = None) -> Any:
        if _on_neuron(model_, inputs_):
            from .compiler.backend import compile_for_neuron

            return compile_for_neuron(model_, inputs_, {**self.config, **(config_patches or {})})
        return inductor_call(self, model_, inputs_, config_patches=config_patches)

    setattr(__call__, _MARK, True)
    __call__.__doc__ = inductor_call.__doc__
    __call__.__wrapped__ = inductor_call  # type: ignore[attr-defined]
    cls.__call__ = __call__
