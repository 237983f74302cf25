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

AOTInductor (``torch._inductor.aot_compile``, which ``aoti_compile_and_package`` and ``torch._export.aot_compile``
call) generates a shared library for the graph's device and has no code generator for neuron: it failed with
``InductorError: KeyError: 'neuron'``. Once ``torch._inductor`` is imported (an import hook: importing it costs
seconds), ``aot_compile`` refuses a graph on neuron tensors with a ``NotImplementedError`` that says what to do.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_MARK = "_torchneuron_lab_redirect"
_AOTI_REFUSAL = (
    "AOTInductor (torch._inductor.aot_compile / aoti_compile_and_package) does not generate code for the neuron "
    "device: the emulated NeuronCore runs Inductor's CPU code through torch.compile(backend=\"neuron\"). Export "
    "and package the model on CPU (move the module and example inputs with .to(\"cpu\") before torch.export), "
    "or compile it with torch.compile"
)


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


def _refuse_aoti_on_neuron(inductor: Any) -> None:
    """Wrap ``torch._inductor.aot_compile`` (the module global its callers look up) once."""
    aot_compile = getattr(inductor, "aot_compile", None)
    if aot_compile is None or getattr(aot_compile, _MARK, False):
        return

    def wrapped(gm: Any, args: Any, kwargs: Any = None, **options: Any) -> Any:
        from torch.utils._pytree import tree_leaves

        if _on_neuron(gm, tree_leaves((args, kwargs))):
            raise NotImplementedError(_AOTI_REFUSAL)
        return aot_compile(gm, args, kwargs, **options)

    setattr(wrapped, _MARK, True)
    wrapped.__doc__ = aot_compile.__doc__
    wrapped.__wrapped__ = aot_compile  # type: ignore[attr-defined]
    inductor.aot_compile = wrapped


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs each callback with the module right after ``name`` is first executed (a post-import hook)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.callbacks: list[Any] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, finder = spec.loader, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)  # type: ignore[union-attr]
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)
                for callback in finder.callbacks:
                    callback(module)

        spec.loader = _Loader()
        return spec


def after_import(name: str, callback: Any) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after its import (once per callback)."""
    mod = sys.modules.get(name)
    if mod is not None:
        callback(mod)
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == name), None)
    if finder is None:
        finder = _AfterImport(name)
        sys.meta_path.insert(0, finder)
    if callback not in finder.callbacks:
        finder.callbacks.append(callback)


def release_stacks_at_dynamo_reset(dynamo: Any) -> None:
    """``torch._dynamo.reset()`` (and ``torch.compiler.reset()``, which calls it) then releases the launch
    stacks the device interned: they hold the code objects of the frames that launched, and Dynamo's code for
    a compiled frame holds the compiled function, so a reset freed no graph whose kernels had launched. The
    stacks are released only when no recorded event refers to them (the next ``recorder_clear`` does it
    otherwise). Installed once ``torch._dynamo`` is imported, whether or not the program compiles for neuron."""
    original = getattr(dynamo, "reset", None)
    if original is None or getattr(original, "_tnl_releases_stacks", False):
        return

    def reset() -> None:
        original()
        from .device._backend import lib

        lib().release_stacks_if_unreferenced()

    reset.__doc__ = original.__doc__
    reset.__wrapped__ = original  # type: ignore[attr-defined]
    reset._tnl_releases_stacks = True  # type: ignore[attr-defined]
    dynamo.reset = reset


def neuron(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
    """Dynamo's ``"neuron"`` backend: ``torchneuron_lab.compiler.backend.neuron_backend``, imported at the first
    compile."""
    from .compiler.backend import neuron_backend

    return neuron_backend(gm, example_inputs, **kwargs)


def register_dynamo_backend(dynamo: Any) -> None:
    """``"neuron"`` in Dynamo's registry as soon as Dynamo is imported. Left to its entry point, the first
    ``torch.compile(backend="neuron")`` of two threads at once raced in Dynamo's lookup (both loaded the entry
    point and registered it: ``AssertionError: duplicate name: neuron``)."""
    from torch._dynamo.backends import registry

    if "neuron" not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=neuron, name="neuron")


def _register_process_group_backend(_c10d: Any) -> None:
    """torch.distributed's ``neuron`` backend (distributed/__init__.py), once c10d is imported."""
    from .distributed import register_backend

    register_backend()


def install_import_hooks() -> None:
    """AOTInductor's refusal of neuron graphs, Dynamo's reset releasing launch stacks and the ``"neuron"``
    backend's registration, each installed when its module is imported (importing either costs seconds:
    not at registration)."""
    after_import("torch._inductor", _refuse_aoti_on_neuron)
    after_import("torch._dynamo", release_stacks_at_dynamo_reset)
    after_import("torch._dynamo", register_dynamo_backend)
    after_import("torch.distributed.distributed_c10d", _register_process_group_backend)
