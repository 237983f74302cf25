"""``torch.compile(backend="neuron")``: Dynamo -> Inductor's whole pipeline -> C++ kernels on device memory.

TorchNeuron's compile path is Dynamo -> AOTAutograd -> FX passes -> (StableHLO -> neuronx-cc -> NEFF)
-> runtime. Ours has the same shape; its last stage is Inductor's C++/OpenMP code generation for the
CPU, and the compiled graph runs on zero-copy CPU aliases of the neuron tensors' memory:

1. Dynamo captures the graph; this backend records it in the subgraph registry.
2. ``compile_fx`` (Inductor's entry point, unchanged) runs on the neuron graph: pre-grad passes,
   AOTAutograd with Inductor's decompositions (plus, for the ops the device upcasts or composes where
   CUDA has a kernel the CPU lacks, what the device computes: ``cuda_parity.py``), the joint-graph
   passes (``replace_random``, pattern matchers), the min-cut partitioner. Only its ``inner_compile``
   is ours (``_inner_compile``).
3. ``_inner_compile`` retargets each forward/backward/inference ATen graph to the CPU - device
   arguments rewritten, fake tensors moved with their exact sizes, strides, offsets and storage
   sharing (never re-propagated through CPU meta functions, whose layout choices can differ) - and
   hands it to ``compile_fx_inner`` (post-grad passes, lowering, FX graph cache).
4. At run time the compiled graph is called through ``run_on_host``: inputs become CPU aliases of
   device memory (no copy), every buffer the graph allocates comes from the neuron caching allocator
   (so it shows in ``torch.neuron.memory_stats``), and outputs are adopted back as neuron tensors on
   the device eager would use (CPU results stay CPU tensors, other neuron devices get a copy; a graph
   naming a missing device raises eager's error).

Why compile_fx with our inner compiler rather than registering ``neuron`` as an Inductor device: every
Inductor pass runs as Inductor-CPU runs it, and code generation sees a CPU graph, so no
``device.type == "cpu"`` decision inside Inductor has to be re-validated for a new device.

Each fused-kernel launch and extern-kernel call is a recorder event tagged with the subgraph id.
"""

from __future__ import annotations

import ast
import collections
import ctypes
import functools
import os
import re
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..device import DEVICE_TYPE
from ..device import register as _register_device
from ..device._backend import lib
from . import capture, cuda_parity, registry
from .registry import SubgraphRecord

__all__ = ["neuron_backend", "register_backend"]

_state = threading.local()
_graph_counter = iter(range(1, 1 << 62))

_TENSOR_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "matmul", "linear", "addmv")
_VECTOR_HINTS = ("sum", "mean", "amax", "amin", "max", "min", "softmax", "norm", "var", "std", "logsumexp",
                 "prod", "argmax", "argmin", "cumsum", "any", "all")
_GATHER_HINTS = ("index", "gather", "scatter", "embedding", "sort", "topk")


def _engine_for(ops: Sequence[str]) -> str:
    names = [o.split(".")[-1] if "." in o else o for o in ops]
    if any(n in _TENSOR_OPS for n in names):
        return "tensor"
    if any(h in n for n in names for h in _GATHER_HINTS):
        return "gpsimd"
    if any(h in n for n in names for h in _VECTOR_HINTS):
        return "vector"
    return "scalar"


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


def _mm_flops(name: str, args: Sequence[Any]) -> int:
    ts = [a for a in args if isinstance(a, torch.Tensor)]
    try:
        if name == "mm" and len(ts) >= 2:
            return 2 * ts[0].shape[0] * ts[0].shape[1] * ts[1].shape[1]
        if name == "addmm" and len(ts) >= 3:
            return 2 * ts[1].shape[0] * ts[1].shape[1] * ts[2].shape[1]
        if name == "bmm" and len(ts) >= 2:
            return 2 * ts[0].shape[0] * ts[0].shape[1] * ts[0].shape[2] * ts[1].shape[2]
        if name == "baddbmm" and len(ts) >= 3:
            return 2 * ts[1].shape[0] * ts[1].shape[1] * ts[1].shape[2] * ts[2].shape[2]
    except (IndexError, RuntimeError):
        return 0
    return 0


def _timed_kernel(fn: Callable[..., Any], name: str, aten_ops: list[str], const_mask: list[bool]) -> Callable[..., Any]:
    engine = _engine_for(aten_ops)
    C = lib()

    @functools.wraps(fn)
    def kernel(*args: Any) -> Any:
        run = getattr(_state, "run", None)
        if run is None or not C.recorder_enabled():
            return fn(*args)
        t0 = C.now_ns()
        out = fn(*args)
        t1 = C.now_ns()
        read = written = 0
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if i < len(const_mask) and const_mask[i]:
                    read += _nbytes(a)
                else:
                    written += _nbytes(a)
        C.recorder_push("kernel", name, run[1], engine, t0, t1, read, written, 0, run[0], "")
        return out

    kernel._tnl_wrapped = True  # type: ignore[attr-defined]
    return kernel


class _ExternKernels:
    """Stands in for Inductor's ``extern_kernels`` module in a compiled wrapper: times each call.

    One timed function per kernel name, made on first use and kept as an attribute (later lookups do
    not reach ``__getattr__``)."""

    _tnl_wrapped = True

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        if not callable(target):
            return target
        C = lib()
        engine = "tensor" if name in _TENSOR_OPS else _engine_for([name])
        label = f"extern: aten::{name}"

        def call(*args: Any, **kwargs: Any) -> Any:
            run = getattr(_state, "run", None)
            if run is None or not C.recorder_enabled():
                return target(*args, **kwargs)
            t0 = C.now_ns()
            out = target(*args, **kwargs)
            t1 = C.now_ns()
            read = sum(_nbytes(a) for a in args)
            written = _nbytes(kwargs.get("out"))
            C.recorder_push("kernel", label, run[1], engine, t0, t1, read, written, _mm_flops(name, args), run[0], "")
            return out

        setattr(self, name, call)
        return call


class _TimedOverload:
    def __init__(self, op: Any, name: str) -> None:
        self._op, self._name = op, name
        self._engine = _engine_for([name])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        C = lib()
        run = getattr(_state, "run", None)
        if run is None or not C.recorder_enabled():
            return self._op(*args, **kwargs)
        t0 = C.now_ns()
        out = self._op(*args, **kwargs)
        t1 = C.now_ns()
        outs = out if isinstance(out, (tuple, list)) else (out,)
        C.recorder_push("kernel", self._name, run[1], self._engine, t0, t1,
                        sum(_nbytes(a) for a in args), sum(_nbytes(o) for o in outs), 0, run[0], "")
        return out


class _NamedOverload:
    """An ATen fallback in a queued graph's code while recording: its eager launches are recorded under the
    name the graph's kernel list gives it (``aten::topk.default``)."""

    def __init__(self, op: Any, name: str) -> None:
        self._op = op
        self._id = lib().intern_string(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        C = lib()
        prev = C.set_launch_name(self._id)
        try:
            return self._op(*args, **kwargs)
        finally:
            C.set_launch_name(prev)


class _Ns:
    """Attribute proxy: ``torch`` -> ``torch.ops`` -> ``torch.ops.aten`` -> packet -> timed overload.

    Each attribute is resolved once and kept on the proxy (the wrapper reads the same names per call)."""

    _tnl_wrapped = True

    def __init__(self, inner: Any, path: str, wanted: set[str], make: Callable[[Any, str], Any] | None = None) -> None:
        self._inner, self._path, self._wanted = inner, path, wanted
        self._make = make or _TimedOverload

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # a packet called without its overload
        return self._inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        path = f"{self._path}.{name}" if self._path else name
        parts = path.split(".")
        if parts[0] != "ops" or len(parts) > 4:
            res = target
        elif len(parts) == 4:  # ops.<namespace>.<op>.<overload>: aten's, a custom op library's, prims' ...
            label = f"{parts[1]}::{parts[2]}.{parts[3]}"
            res = self._make(target, label) if label in self._wanted else target
        else:
            res = _Ns(target, path, self._wanted, self._make)
        if not name.startswith("__"):
            setattr(self, name, res)
        return res


def _TorchWithTimedFallbacks(torch_mod: Any, wanted: set[str]) -> Any:
    return _Ns(torch_mod, "", wanted)


_PYBINDING = re.compile(r"^(?P<name>cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[(?P<args>[^\]]*)\]", re.M)
_ORIGIN = re.compile(r"Original ATen: \[(?P<ops>[^\]]*)\]")


@functools.lru_cache(maxsize=None)
def _aten_op_names() -> frozenset[str]:
    return frozenset(n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                     if n.startswith("aten::"))


def _ops_from_kernel_name(name: str) -> list[str]:
    """``cpp_fused_relu_threshold_backward_3`` -> ``["aten.relu", "aten.threshold_backward"]``: Inductor names
    a kernel by its sorted original ATen ops joined with ``_``; split on real op names, longest first."""
    s = re.sub(r"^cpp_fused_|_\d+$", "", name)
    names = _aten_op_names()

    @functools.lru_cache(maxsize=None)
    def seg(i: int) -> tuple[str, ...] | None:
        if i >= len(s):
            return ()
        for j in range(len(s), i, -1):
            if s[i:j] in names and (j == len(s) or s[j] == "_"):
                rest = seg(j + 1)
                if rest is not None:
                    return (s[i:j], *rest)
        return None

    ops = seg(0)
    return [f"aten.{o}" for o in ops] if ops else [f"aten.{s}"]


def _kernels_from_source(src: str) -> tuple[list[dict[str, Any]], list[str], dict[str, list[bool]]]:
    """(kernels, fallback ops, const masks) read from Inductor's generated wrapper source."""
    kernels: list[dict[str, Any]] = []
    masks: dict[str, list[bool]] = {}
    for m in _PYBINDING.finditer(src):
        masks[m.group("name")] = ["const" in a for a in m.group("args").split(",")]
    pending_ops: list[str] = []
    fallbacks: list[str] = []
    seen: set[str] = set()
    in_call = False
    for line in src.splitlines():
        s = line.strip()
        if s.startswith("def call(self, args)") or s.startswith("def call(args)"):
            in_call = True
            continue
        if not in_call:
            continue
        om = _ORIGIN.search(s)
        if om:
            pending_ops = [o.strip() for o in om.group("ops").split(",") if o.strip()]
            continue
        km = re.match(r"(cpp_fused_\w+)\(", s)
        if km and km.group(1) not in seen:
            name = km.group(1)
            seen.add(name)
            ops = pending_ops or _ops_from_kernel_name(name)
            kernels.append({"name": name, "aten_ops": ops, "kind": "fused"})
            pending_ops = []
            continue
        em = re.search(r"extern_kernels\.(\w+)\(", s)
        if em:
            kernels.append({"name": f"extern: aten::{em.group(1)}", "aten_ops": pending_ops or [f"aten.{em.group(1)}"],
                            "kind": "extern"})
            fallbacks.append(f"aten::{em.group(1)}")
            pending_ops = []
            continue
        am = re.search(r"torch\.ops\.(\w+)\.(\w+)\.(\w+)\(", s)
        if am:  # an op Inductor calls as it is: aten's, or any library's (a custom op, transformers' grouped_mm)
            ns, op, overload = am.groups()
            fallbacks.append(f"{ns}::{op}.{overload}")
            kernels.append({"name": f"{ns}::{op}.{overload}", "aten_ops": [f"{ns}.{op}"], "kind": "aten-fallback"})
            pending_ops = []
    return kernels, sorted(set(fallbacks)), masks


class _Timing:
    """The timed stand-ins of one compiled wrapper module's kernels, in its globals only while recording.

    Inductor's generated ``call`` reads its kernels (``cpp_fused_*``, ``extern_kernels``, ``torch`` for
    ATen fallbacks) from the module's globals on every call. While the recorder is off the module runs
    with its own objects (no wrapper in the way); a graph call that finds the recorder on swaps the
    timed stand-ins in (and back when it finds it off). Modules are shared by every graph with the same
    code (Inductor's code cache), so the stand-ins pass through untimed outside a neuron graph call.
    """

    def __init__(self, gl: dict[str, Any], timed: dict[str, Any]) -> None:
        self.gl = gl
        self.raw = {k: gl[k] for k in timed}
        self.timed = timed
        self.on = False

    def set(self, on: bool) -> None:
        if on != self.on:
            self.gl.update(self.timed if on else self.raw)
            self.on = on


def _instrument(compiled: Any) -> tuple[list[dict[str, Any]], list[str], _Timing | None]:
    src = getattr(compiled, "source_code", None) or ""
    kernels, fallbacks, masks = _kernels_from_source(src)
    call = getattr(compiled, "current_callable", None)
    gl = getattr(call, "__globals__", None)
    if gl is None:
        return kernels, fallbacks, None
    timing = gl.get("_tnl_timing")
    if isinstance(timing, _Timing):  # the same module compiled for another graph
        return kernels, fallbacks, timing
    origins = {k["name"]: k["aten_ops"] for k in kernels}
    timed: dict[str, Any] = {}
    for name in list(gl):
        if name.startswith("cpp_fused_") and callable(gl[name]) and not getattr(gl[name], "_tnl_wrapped", False):
            timed[name] = _timed_kernel(gl[name], name, origins.get(name, []), masks.get(name, []))
    fallback_ops = {k["name"] for k in kernels if k["kind"] == "aten-fallback"}
    if fallback_ops and "torch" in gl and not getattr(gl["torch"], "_tnl_wrapped", False):
        timed["torch"] = _TorchWithTimedFallbacks(gl["torch"], fallback_ops)
    ek = gl.get("extern_kernels")
    if ek is not None and not getattr(ek, "_tnl_wrapped", False):
        timed["extern_kernels"] = _ExternKernels(ek)
    timing = _Timing(gl, timed)
    gl["_tnl_timing"] = timing
    return kernels, fallbacks, timing


def _cpu_device(a: Any) -> Any:
    if isinstance(a, torch.device) and a.type == DEVICE_TYPE:
        return torch.device("cpu")
    return a


class _Retarget:
    """Moves an ATen graph's fake tensors and device arguments from neuron to cpu, nothing else.

    Every fake tensor keeps its exact sizes, strides, storage offset and dtype, and fake tensors that
    share a neuron storage share one CPU storage (Inductor's alias analysis reads storages): values are
    not re-propagated through CPU meta functions, whose layout choices (e.g. channels-last convolution
    outputs) can differ from the neuron ones the graph was traced with.
    """

    def __init__(self, fake_mode: Any) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak = StorageWeakRef
        self.fake_mode = fake_mode
        self._bases: dict[Any, torch.Tensor] = {}
        self._done: dict[int, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []  # keeps ids in _done unique while this object lives
        self.devices: set[int] = set()

    def tensor(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device.type != DEVICE_TYPE:
            return t
        hit = self._done.get(id(t))
        if hit is not None:
            return hit
        self.devices.add(int(t.device.index or 0))
        st = t.untyped_storage()
        key = self._weak(st)
        with self.fake_mode:
            base = self._bases.get(key)
            if base is None:
                base = torch.empty(st.nbytes(), dtype=torch.uint8, device="cpu")
                self._bases[key] = base
            typed = base if t.dtype == torch.uint8 else base.view(t.dtype)
            out = typed.as_strided(t.size(), t.stride(), t.storage_offset())
        self._done[id(t)] = out
        self._keep.append(t)
        return out

    def value(self, v: Any) -> Any:
        from torch.utils._pytree import tree_map

        return tree_map(self.tensor, v)

    def graph(self, gm: torch.fx.GraphModule) -> None:
        from torch.utils._pytree import tree_map

        def dev(a: Any) -> Any:
            if isinstance(a, torch.device) and a.type == DEVICE_TYPE:
                self.devices.add(int(a.index or 0))
            return _cpu_device(a)

        for node in gm.graph.nodes:
            node.args = tree_map(dev, node.args)
            node.kwargs = tree_map(dev, node.kwargs)
            for key in ("val", "eager_input_vals"):  # the latter: a higher-order op's operands as traced
                if key in node.meta:
                    node.meta[key] = self.value(node.meta[key])
            if node.op == "get_attr":
                sub = self._attr(gm, str(node.target))
                if isinstance(sub, torch.fx.GraphModule):  # a cond/while_loop branch, an invoke_subgraph body
                    self.graph(sub)
                else:
                    self.constant(gm, str(node.target))
        gm.recompile()

    @staticmethod
    def _owner(gm: torch.fx.GraphModule, target: str) -> tuple[torch.nn.Module, str]:
        owner, _, name = target.rpartition(".")
        return (gm.get_submodule(owner) if owner else gm), name

    def _attr(self, gm: torch.fx.GraphModule, target: str) -> Any:
        mod, name = self._owner(gm, target)
        return getattr(mod, name, None)

    def constant(self, gm: torch.fx.GraphModule, target: str) -> None:
        """A real tensor the graph reads (``torch.tensor([1., 2.], device=x.device)`` in the user's code,
        lifted by Dynamo) becomes a CPU copy: Inductor's code generation sees only CPU tensors, and the
        queued graph's code moves its CPU constants back to the device once (``_queued_callables``)."""
        mod, name = self._owner(gm, target)
        v = getattr(mod, name, None)
        if not isinstance(v, torch.Tensor) or v.device.type != DEVICE_TYPE:
            return
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        self.devices.add(int(v.device.index or 0))
        with unset_fake_temporarily():  # a real constant, copied outside the compile's fake mode
            cpu = v.detach().to("cpu")
            if isinstance(v, torch.nn.Parameter):
                cpu = torch.nn.Parameter(cpu, requires_grad=v.requires_grad)
        if name in getattr(mod, "_buffers", {}):
            mod._buffers[name] = cpu
        elif name in getattr(mod, "_parameters", {}):
            mod._parameters[name] = cpu
        else:
            setattr(mod, name, cpu)


def _output_devices(gm: torch.fx.GraphModule) -> list[torch.device | None]:
    """The device of each graph output as traced (None for non-tensors)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    res: list[torch.device | None] = []
    for a in out.args[0]:
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        res.append(v.device if isinstance(v, torch.Tensor) else None)
    return res


def _written_inputs(gm: torch.fx.GraphModule) -> set[int]:
    """Positions of the graph's inputs that an op writes in place (``copy_`` of an input mutation that
    AOTAutograd keeps in the graph, or any op whose schema marks the argument as written)."""
    position = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if v in position:
                    written.add(position[v])
    return written


def _draws_random(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph has an op that draws from a generator (``torch.Tag.nondeterministic_seeded``:
    Inductor's ``inductor_seeds``, ``randperm``, ``bernoulli``, ...)."""
    for node in gm.graph.nodes:
        tags = getattr(node.target, "tags", ()) if node.op == "call_function" else ()
        if torch.Tag.nondeterministic_seeded in tags:
            return True
    return False


class _DeviceRandom:
    """Runs host code with the CPU default generator standing in for neuron:d's generator.

    A graph retargeted to the CPU draws its random numbers (Inductor's seeds, random fallbacks) from
    the CPU default generator. Around a neuron graph call, that generator takes the state of neuron:d's
    generator (the mt19937 engine it drives, the CPU's algorithm) and gives it back afterwards, so
    ``torch.neuron.manual_seed`` controls compiled random ops on neuron and the CPU stream is left
    as it was, as ``torch.cuda.manual_seed`` does for CUDA graphs.
    """

    def __init__(self, device: int) -> None:
        self.engine = lib().generator_engine(device)
        self.cpu = torch.default_generator

    def __enter__(self) -> None:
        self.saved = self.cpu.get_state()
        self.cpu.set_state(self.engine.get_state())

    def __exit__(self, *exc: object) -> None:
        self.engine.set_state(self.cpu.get_state())
        self.cpu.set_state(self.saved)


def _input_signature(example_inputs: Sequence[Any]) -> list[dict[str, Any]]:
    sig: list[dict[str, Any]] = []
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            dyn = [i for i, s in enumerate(t.shape) if not isinstance(s, int)]
            sig.append({"shape": [str(s) for s in t.shape], "dtype": str(t.dtype).replace("torch.", ""),
                        "device": str(t.device), "dynamic_dims": dyn})
        else:
            sig.append({"shape": None, "dtype": type(t).__name__, "device": None, "dynamic_dims": [],
                        "value": str(t)})
    return sig


def _user_source(gm: torch.fx.GraphModule) -> list[dict[str, Any]]:
    seen: dict[tuple[str, int], dict[str, Any]] = {}
    pat = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n\s*(?P<code>.*)')
    for node in gm.graph.nodes:
        st = node.meta.get("stack_trace")
        if not st:
            continue
        matches = list(pat.finditer(st))
        if not matches:
            continue
        m = matches[-1]  # innermost user frame
        key = (m.group("file"), int(m.group("line")))
        if key not in seen:
            seen[key] = {"filename": key[0], "line": key[1], "name": m.group("fn"), "code": m.group("code").strip(),
                         "location": capture._location(key[0], key[1])}
    return sorted(seen.values(), key=lambda d: (d["filename"], d["line"]))


def _traced_function() -> str | None:
    """Name of the function Dynamo is compiling (its frame's code object), if known."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code = tx.f_code
    except Exception:  # noqa: BLE001 - not inside Dynamo's tracer
        return None
    name = code.co_qualname if hasattr(code, "co_qualname") else code.co_name
    if "/torch/" in code.co_filename.replace("\\", "/"):  # Dynamo's own wrapper (e.g. an nn.Module call)
        return None
    return str(name)


def _module_name(gm: torch.fx.GraphModule) -> str | None:
    """``Sequential.forward`` for a compiled module, from the graph's nn_module_stack."""
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            path, ty = next(iter(stack.values()))
            tyname = getattr(ty, "__name__", None) or str(ty).rsplit(".", 1)[-1].strip("'>")
            return f"{tyname}.forward"
    return None


def _op_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    c: collections.Counter[str] = collections.Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            c[str(node.target)] += 1
    return dict(c.most_common())


def _run_device(example_inputs: Sequence[Any], graph_devices: set[int]) -> int:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE:
            return int(t.device.index or 0)
    valid = sorted(d for d in graph_devices if d < int(lib().device_count()))
    return valid[0] if valid else int(lib().current_device())


def _inner_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: dict[str, Any],
                   **kwargs: Any) -> Any:
    """Inductor's ``inner_compile`` for one forward/backward/inference graph of ``compile_fx``.

    ``compile_fx`` has already run Inductor's pre-grad passes, AOTAutograd with its decompositions,
    joint-graph passes (``replace_random``, pattern matchers) and partitioner on the neuron graph; this
    retargets the graph to the CPU (exact strides kept), hands it to ``compile_fx_inner`` (post-grad
    passes, lowering, C++ code generation, FX graph cache) and returns code that runs on device memory.
    """
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx_inner

    kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
    t0 = time.perf_counter()
    fx_code = gm.print_readable(print_output=False)
    op_counts = _op_counts(gm)
    inputs = _input_signature(example_inputs)
    out_devices = _output_devices(gm)
    written = _written_inputs(gm)
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(example_inputs)
    assert fake_mode is not None, "AOTAutograd passes fake tensors to the compiler"
    rt = _Retarget(fake_mode)
    cpu_inputs = [rt.tensor(t) for t in example_inputs]
    rt.graph(gm)
    device = _run_device(example_inputs, rt.devices)
    n_dev = int(lib().device_count())
    bad_devices = sorted(d for d in rt.devices if d >= n_dev)
    hits0 = counters["inductor"]["fxgraph_cache_hit"]
    if "get_decomp_fn" in kwargs:
        # lowering sees Inductor's own table: ops the parity decompositions call again in a widened dtype
        # (e.g. _upsample_bilinear2d_aa) stay Inductor's implicit fallbacks
        from torch._inductor.decomposition import select_decomp_table

        kwargs["get_decomp_fn"] = select_decomp_table
    compiled = compile_fx_inner(gm, cpu_inputs, **kwargs)
    hits = counters["inductor"]["fxgraph_cache_hit"] - hits0
    kernels, fallbacks, timing = _instrument(compiled)
    seeded = _draws_random(gm)
    lowering_ms = (time.perf_counter() - t0) * 1e3
    ctx["lowering_s"] = ctx.get("lowering_s", 0.0) + lowering_ms / 1e3
    rid = registry._new_id()
    rec = SubgraphRecord(
        id=rid,
        name=f"{kind} of {ctx['function']} (compile {ctx['compile_id']})",
        kind=kind,
        compile_id=ctx["compile_id"],
        graph_key=ctx["graph_key"],
        function=ctx["function"],
        source=ctx["source"],
        fx_code=fx_code,
        op_counts=op_counts,
        inputs=inputs,
        guards=[],
        compile_ms={"dynamo": ctx.get("dynamo_ms"), "aot_autograd": None, "lowering": lowering_ms},
        kernels=kernels,
        fallbacks=fallbacks,
        cache_hits=int(hits),
        device=device,
    )
    if kind == "backward" and ctx.get("forward_id") is not None:
        rec.pair_id = ctx["forward_id"]
        try:
            registry.get(ctx["forward_id"]).pair_id = rid
        except KeyError:
            pass
    if kind == "forward":
        ctx["forward_id"] = rid
    ctx.setdefault("records", []).append(rec)
    registry._add(rec)
    here = torch.device(DEVICE_TYPE, device)
    cpu_outs = [i for i, d in enumerate(out_devices) if d is not None and d.type == "cpu"]
    moved = [(i, d) for i, d in enumerate(out_devices) if d is not None and d.type == DEVICE_TYPE
             and d != here]
    # CPU 0-dim inputs (a scalar the user keeps on the host: an lr tensor, torch.tensor(2.)) go to the device
    # with the call, as a queued copy of the value at the call: the graph still queues. (As host code, the
    # graph waited for the stream, and an op registered for neuron only got CPU aliases and failed.)
    # A scalar the graph writes (an inference graph's input mutation: Adam's state["step"] += 1 in a compiled
    # step without capturable) is not one: its write must reach the user's tensor, so the graph runs as host
    # code (the write landed on the queued copy, and the step count never advanced).
    scalars = [i for i, t in enumerate(example_inputs)
               if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 0 and i not in written]
    queued: tuple[Any, Any] | str = "inputs or outputs off the device"
    if not (bad_devices or cpu_outs or moved or rt.devices - {device} or any(
            isinstance(t, torch.Tensor) and t.device != here and i not in scalars
            for i, t in enumerate(example_inputs))):
        queued = _queued_callables(compiled, kernels, device)
    rec.launch = queued if isinstance(queued, str) else "queued"
    return _NeuronCode(compiled, rec, device, bad_devices, cpu_outs, moved, timing, seeded,
                       queued if isinstance(queued, tuple) else None, scalars)


def _kernel_arg_types(src: str) -> dict[str, list[str]]:
    """C argument types of each fused kernel (``cpp_fused_relu_0`` -> ``["float*"]``), from the wrapper."""
    return {m.group("name"): [str(t) for t in ast.literal_eval("[" + m.group("args") + "]")]
            for m in _PYBINDING.finditer(src)}


@functools.lru_cache(maxsize=None)
def _entry_point(path: str) -> int:
    """Address of the C entry point (``kernel``) of a kernel module Inductor built (already loaded: the
    same handle, dlopen counts references)."""
    return int(ctypes.cast(ctypes.CDLL(path)["kernel"], ctypes.c_void_p).value or 0)


class _ExternNamed:
    """Stands in for ``extern_kernels`` in a queued graph's code while recording: the eager launch each call
    makes is recorded under the graph code's name for it (``extern: aten::mm``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        if not callable(target):
            return target
        C = lib()
        label = C.intern_string(f"extern: aten::{name}")

        def call(*args: Any, **kwargs: Any) -> Any:
            prev = C.set_launch_name(label)
            try:
                return target(*args, **kwargs)
            finally:
                C.set_launch_name(prev)

        setattr(self, name, call)
        return call


def _queued_callables(compiled: Any, kernels: list[dict[str, Any]], device: int) -> tuple[Any, Any] | str:
    """The compiled graph's generated ``call``, rebound to globals in which it launches on ``neuron:device``:
    buffers are device allocations, fused kernels are ``HostKernel`` launches, ATen calls get neuron tensors
    (eager launches). Returns (plain, recording) callables, or why the graph cannot be queued."""
    if os.environ.get("TORCHNEURON_LAB_QUEUE_GRAPHS", "1") == "0":
        return "TORCHNEURON_LAB_QUEUE_GRAPHS=0"
    call = getattr(compiled, "current_callable", None)
    func = getattr(call, "__func__", call)
    gl = getattr(func, "__globals__", None)
    if not isinstance(func, types.FunctionType) or gl is None or "empty_strided_cpu" not in gl:
        return "not an Inductor C++ wrapper"
    C = lib()
    here = torch.device(DEVICE_TYPE, device)
    # the generated code lives in Inductor's cache (<dir>/<xx>/<key>.py): its frames are not the user's line
    from ..device.recorder import add_internal_path

    add_internal_path(os.path.dirname(os.path.dirname(func.__code__.co_filename)))
    arg_types = _kernel_arg_types(getattr(compiled, "source_code", None) or "")
    origins = {k["name"]: k["aten_ops"] for k in kernels}
    priv = dict(gl)
    timing = gl.get("_tnl_timing")
    if isinstance(timing, _Timing):  # the host path's timed stand-ins may be swapped in: the originals
        priv.update(timing.raw)
    priv.pop("_tnl_timing", None)
    for name, v in list(priv.items()):
        if name.startswith("cpp_fused_") and callable(v):
            path = getattr(getattr(v, "__self__", None), "__file__", None)
            if not path or name not in arg_types:
                return f"{name}: no loadable entry point"
            try:
                priv[name] = C.HostKernel(_entry_point(path), arg_types[name], name,
                                          _engine_for(origins.get(name, [])), device)
            except (NotImplementedError, ValueError, OSError, AttributeError) as e:
                return str(e)
        elif isinstance(v, torch.Tensor) and v.device.type == "cpu":
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():  # called under the compile's fake mode: a real copy
                priv[name] = v.to(here)  # a graph constant lives on the device, as Inductor's do on CUDA
    dev_fn = torch.device

    def empty_strided_device(size: Any, stride: Any, dtype: Any) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=here)

    def device_of(type: Any = None, index: Any = None) -> torch.device:  # noqa: A002 - torch.device's name
        return here if type == "cpu" else dev_fn(type, index) if index is not None else dev_fn(type)

    priv["empty_strided_cpu"] = empty_strided_device
    priv["device"] = device_of
    rec_gl = dict(priv)
    if priv.get("extern_kernels") is not None:
        rec_gl["extern_kernels"] = _ExternNamed(priv["extern_kernels"])
    fallback_ops = {k["name"] for k in kernels if k["kind"] == "aten-fallback"}
    if fallback_ops and "torch" in priv:
        rec_gl["torch"] = _Ns(priv["torch"], "", fallback_ops, _NamedOverload)

    def rebind(g: dict[str, Any]) -> Any:
        for name, v in list(g.items()):  # the module's own functions (helpers the call uses) read g too
            if isinstance(v, types.FunctionType) and v.__globals__ is gl:
                g[name] = types.FunctionType(v.__code__, g, v.__name__, v.__defaults__, v.__closure__)
        f = types.FunctionType(func.__code__, g, func.__name__, func.__defaults__, func.__closure__)
        owner = getattr(call, "__self__", None)
        return types.MethodType(f, owner) if owner is not None else f

    return rebind(priv), rebind(rec_gl)


class _NeuronCode:
    """The compiled graph as AOTAutograd calls it: boxed inputs on device, outputs where eager puts them.

    Inputs become zero-copy CPU aliases (``run_on_host``), buffers come from the neuron allocator and are
    adopted as the graph's neuron outputs on its device; an output traced on the CPU (``x.cpu() * 2``)
    stays a CPU tensor, one traced on another neuron device is moved there; a graph naming a device that
    does not exist raises eager's error on every call.
    """

    _boxed_call = True

    def __init__(self, compiled: Any, rec: SubgraphRecord, device: int, bad_devices: list[int],
                 cpu_outs: list[int], moved: list[tuple[int, torch.device]], timing: _Timing | None = None,
                 seeded: bool = False, queued: tuple[Any, Any] | None = None,
                 scalars: Sequence[int] = ()) -> None:
        self._boxed_call = True  # in __dict__ too: AOTAutograd's functools.wraps copies only that
        self.scalars = tuple(scalars) if queued is not None else ()  # CPU 0-dim inputs of a queued graph
        self.compiled = compiled
        self.rec = rec
        self.device = device
        self.bad_devices = bad_devices
        self.cpu_outs = cpu_outs
        self.moved = moved
        self.timing = timing
        C = lib()
        self._recording = C.recorder_enabled
        self.plan = C.HostPlan(device)  # keeps the inputs' CPU aliases between calls
        self.random = _DeviceRandom(device) if seeded else None
        self._tag = (rec.id, device)
        self.queued = queued  # (plain, recording) callables that launch on the device queue, or None

    def __getattr__(self, name: str) -> Any:  # anything else AOTAutograd reads (e.g. post_compile)
        return getattr(self.__dict__["compiled"], name)

    def __call__(self, args: list[Any]) -> Any:
        self.rec.calls += 1
        if self.bad_devices:
            for d in self.bad_devices:
                torch.empty(0, device=torch.device(DEVICE_TYPE, d))  # raises eager's error
        on = self._recording()
        if self.queued is not None:
            C = lib()
            if self.scalars:
                here = torch.device(DEVICE_TYPE, self.device)
                for i in self.scalars:
                    a = args[i]
                    if isinstance(a, torch.Tensor) and a.device.type == "cpu":
                        args[i] = a.to(here, non_blocking=True)  # the value at the call (a queued copy)
            prev = C.set_launch_subgraph(self.rec.id)
            try:
                return self.queued[1 if on else 0](args)
            finally:
                C.set_launch_subgraph(prev)
        if self.timing is not None:
            self.timing.set(on)
        if self.random is not None:
            with self.random:
                return self._run(args, on)
        return self._run(args, on)

    def _run(self, args: list[Any], on: bool) -> Any:
        if on or self.cpu_outs:
            prev = getattr(_state, "run", None)
            _state.run = self._tag
            try:
                out = self._call_with_cpu_outputs(args) if self.cpu_outs else self.plan.run(self.compiled, args)
            finally:
                _state.run = prev
        else:
            out = self.plan.run(self.compiled, args)
        args.clear()
        if self.moved:
            out = list(out)
            for i, d in self.moved:
                out[i] = out[i].to(d)
        return out

    def _call_with_cpu_outputs(self, args: list[Any]) -> Any:
        cpu_args = {a.untyped_storage().data_ptr() for a in args
                    if isinstance(a, torch.Tensor) and a.device.type == "cpu"}
        stash: dict[int, Any] = {}
        compiled, cpu_outs = self.compiled, self.cpu_outs

        def host(host_args: list[Any]) -> Any:
            res = list(compiled(host_args))
            for i in cpu_outs:
                stash[i], res[i] = res[i], None
            return res

        out = list(self.plan.run(host, args))
        for i, t in stash.items():
            # memory the graph allocated came from the device allocator: give the CPU result CPU memory
            own = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in cpu_args
            out[i] = t.clone(memory_format=torch.preserve_format) if own else t
        return out


def _inductor_config(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """``torch.compile(..., mode=, options=)`` as Inductor's own wrapper reads them: the mode's options, then
    the user's, validated with Inductor's errors (an unknown option or mode raises, as for
    ``backend="inductor"``)."""
    if not mode and not options:
        return {}
    return dict(torch._TorchCompileInductorWrapper(mode, options, None).config)


def neuron_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                   options: dict[str, Any] | None = None, **kwargs: Any) -> Callable[..., Any]:
    """The Dynamo backend registered as ``"neuron"``: Inductor's whole ``compile_fx`` pipeline, with an
    inner compiler that lowers each ATen graph for the CPU and runs it on device memory. ``mode`` and
    ``options`` (``torch.compile``'s) patch Inductor's config as they do for ``backend="inductor"``."""
    return compile_for_neuron(gm, example_inputs, _inductor_config(mode, options))


def compile_for_neuron(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                       config_patches: dict[str, Any] | None = None) -> Callable[..., Any]:
    """:func:`neuron_backend` with Inductor config patches already resolved (also what Inductor's own
    ``torch.compile`` wrapper hands a graph on neuron tensors: ``torchneuron_lab._inductor_redirect``)."""
    register_backend()
    if _synchronizes_in_graph(gm):
        return gm.forward
    from .. import _flex_attention

    _flex_attention.math_for_training(gm)  # Inductor's CPU flex template is inference-only
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    _register_device()
    capture.install()
    t_entry = time.perf_counter()
    compile_id = capture._compile_id() or "?"
    start = _dynamo_start(t_entry)
    source = _user_source(gm)
    function = _traced_function() or _module_name(gm) or (source[0]["name"] if source else "<graph>")
    if "torch_dynamo_resume_in_" in function:
        function = function.split(".")[-1]
    if function.startswith("torch_dynamo_resume_in_"):
        m = re.match(r"torch_dynamo_resume_in_(\w+?)_at_(\d+)", function)
        if m:
            function = f"{m.group(1)} (after the break at line {m.group(2)})"
    ctx: dict[str, Any] = {
        "compile_id": compile_id,
        "graph_key": next(_graph_counter),
        "function": function,
        "source": source,
        "dynamo_ms": (t_entry - start) * 1e3 if start is not None else None,
    }
    # AOTAutograd's cache would hand back CPU code without the device runtime around it: off for this
    # compile (Inductor's FX graph cache, below the inner compiler, stays on). The decomposition table
    # depends on Inductor's config (`fallback_random` keeps eager's random ops): chosen under the caller's
    # patches, as compile_fx chooses its own (with them applied only inside compile_fx, options=
    # {"fallback_random": True} drew Inductor's random numbers, not eager's).
    with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(config_patches or {}):
        decompositions = cuda_parity.decompositions(select_decomp_table())
        compiled = compile_fx(gm, example_inputs, inner_compile=functools.partial(_inner_compile, ctx=ctx),
                              decompositions=decompositions, config_patches=config_patches or None)
    total_ms = (time.perf_counter() - t_entry) * 1e3
    for rec in ctx.get("records", []):
        if rec.kind in ("forward", "inference"):
            rec.compile_ms["aot_autograd"] = max(0.0, total_ms - ctx.get("lowering_s", 0.0) * 1e3)
    return compiled


_HOST_SYNC_OPS = ("synchronize_stream", "synchronize_event", "synchronize_device")


def _synchronizes_in_graph(gm: torch.fx.GraphModule) -> bool:
    """Whether Dynamo traced a host synchronisation (``stream.synchronize()``, ``event.synchronize()``,
    ``torch.neuron.synchronize()``) into the graph. Inductor's wrapper frees the graph's inputs before such a
    side-effect op and reads them after it (``UnboundLocalError: cannot access local variable 'arg0_1'``; Inductor
    on CPU tensors fails the same way in torch 2.13): such a graph runs as Dynamo traced it, op by op."""
    streams_ns = getattr(torch.ops, "streams", None)
    if streams_ns is None:
        return False
    packets = [getattr(streams_ns, name, None) for name in _HOST_SYNC_OPS]
    targets = {p for p in packets if p is not None} | {p.default for p in packets if p is not None}
    return any(n.op == "call_function" and n.target in targets for n in gm.graph.nodes)


def _dynamo_start(now: float) -> float | None:
    """``perf_counter`` time at which Dynamo started compiling the frame being compiled now.

    Read from Dynamo's own per-frame metrics context (entered when Dynamo starts on a frame, whatever
    the backend), so it never carries the start of another compile: another backend's compile of the
    same function, a compile before ``torch._dynamo.reset()`` that reused this compile id, ...
    """
    from torch._dynamo.utils import get_metrics_context

    mc = get_metrics_context()
    t0_ns = getattr(mc, "_start_time_ns", 0) if mc.in_progress() else 0
    if not t0_ns:
        return None
    return now - (time.time_ns() - t0_ns) / 1e9


_registered = False


def register_backend() -> None:
    """Register ``"neuron"`` with Dynamo (idempotent; the package's entry point does the same lazily)."""
    global _registered
    if _registered:
        return
    from torch._dynamo import list_backends
    from torch._dynamo.backends.registry import register_backend as _reg

    if "neuron" not in list_backends(exclude_tags=()):
        _reg(name="neuron")(neuron_backend)
    capture.install()
    from . import device_interface

    device_interface.register()
    import torch._dynamo

    from .._inductor_redirect import release_stacks_at_dynamo_reset

    release_stacks_at_dynamo_reset(torch._dynamo)  # (done at the device's registration once Dynamo is imported)
    _registered = True
