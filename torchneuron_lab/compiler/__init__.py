"""The JIT runtime: ``torch.compile(backend="neuron")``, the subgraph registry, graph-break capture."""

from __future__ import annotations

from . import capture, registry, signatures
from .backend import neuron_backend, register_backend
from .explain import ExplainReport, explain
from .registry import SubgraphRecord, list_subgraphs

__all__ = [
    "ExplainReport",
    "SubgraphRecord",
    "capture",
    "explain",
    "list_subgraphs",
    "neuron_backend",
    "register_backend",
    "registry",
    "signatures",
]

register_backend()
