"""OpInfo conformance sweep: run PyTorch's OpInfo samples on CPU and on a target device and compare.

Two modes share this file:

* **driver** (default): splits the op list into chunks and runs every chunk in a child process, two
  at a time, so that a segfault/abort inside one op is recorded as ``crash`` for that op instead of
  killing the sweep.  A hung op is killed after ``--timeout`` seconds and recorded as an error.
  Writes ``<report>.json`` and ``<report>.md`` and prints the summary line::

      python -m tests.conformance.opinfo_sweep --device neuron
      python tests/conformance/opinfo_sweep.py --device cpu --report /tmp/opinfo_cpu

* **child** (``--chunk i --nchunks n`` or ``--ops-file``): runs the ops of one chunk in-process and
  writes ``--out part.json``.  Before each op it appends a ``start`` event naming the op to the
  progress file (``--progress``, default ``<out>.progress``) and after it a ``result`` event, so the
  driver knows which op was running when a child died.

Per op (id = ``op.name`` plus ``.variant_test_name`` when set): float32 samples from
``op.sample_inputs('cpu', torch.float32, requires_grad=False)`` (at most ``--max-samples``), every
tensor in input/args/kwargs copied to the device (non-tensor arguments kept, except that a ``'cpu'``
device argument, as used by factory functions and ``Tensor.to``, is pointed at the target device),
outputs compared recursively with ``torch.testing.assert_close`` (the op's float32
``toleranceOverride`` if looser than the default, ``equal_nan=True``), plus the tensors of the
sample itself afterwards (in-place ops), and every device output must be on the target device.
Ops with randomness or uninitialized outputs are compared by shape/dtype/device only.

Status per op: ``pass`` (every runnable sample passed), ``fail`` (a mismatch), ``error`` (the device
raised where CPU did not; also ``timeout``), ``crash`` (the child process died in the op), ``skip``
(no float32 on CPU, non-strided layout, no samples, or CPU itself raised on every sample).

A test hook: ``--ops-hook FILE.py:FUNC`` (or ``package.module:FUNC``) names a function that takes the
op list and returns the list to sweep; it is loaded in every child, so it can add fake ops (e.g. one
that calls ``os.abort()``) to test the crash handling.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import itertools
import json
import math
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MAX_SAMPLES = 100000
DEFAULT_TIMEOUT_S = 60.0
# A child with no op running (importing the backend, which may JIT-build it, or exiting) that is
# silent for this long is killed; also the preflight's limit.
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_WORKERS = 2
DEFAULT_CHUNKS_PER_WORKER = 4
# float32 is the bar of issue 2; TORCHNEURON_LAB_OPINFO_DTYPE (e.g. float64, int64) sweeps another dtype
# (children inherit the environment). Tolerances stay the float32 defaults unless the op overrides them.
DTYPE = getattr(torch, os.environ.get("TORCHNEURON_LAB_OPINFO_DTYPE", "float32"))
# torch.testing.assert_close defaults for float32.
DEFAULT_RTOL = 1.3e-6
DEFAULT_ATOL = 1e-5
MSG_LIMIT = 1500

STATUSES = ("pass", "fail", "error", "crash", "skip")
_SEVERITY = {"crash": 0, "error": 1, "fail": 2, "skip": 3, "pass": 4}

# Ops whose output depends on a random generator: compare shape/dtype/device only.  Matched against
# the dot/underscore separated words of the op name, so "normalize" or "__rand__" do not match.
_RANDOM_WORDS = re.compile(
    r"(?:^|[._])(?:rand|randn|randint|rand_like|randn_like|randint_like|rrelu|bernoulli|multinomial|"
    r"normal|log_normal|uniform|exponential|cauchy|geometric|gumbel_softmax|"
    r"\w*dropout\w*)(?:$|[._])"
)
# Names that contain one of the words above but are deterministic.
_NOT_RANDOM = {
    "signal.windows.exponential",  # a window function
    "native_dropout_backward",  # grad * mask * scale, the mask is an input
}
# Ops that return (partly) uninitialized memory, beyond OpInfo.has_nondeterministic_output.
_UNINITIALIZED = {"resize_", "resize_as_"}
# Positional args (index into sample.args) that the op's API requires to be CPU tensors on every
# device; they are copied but not moved.
_CPU_ARGS: dict[str, tuple[int, ...]] = {
    "tensor_split": (0,),  # tensor_indices_or_sections "expected to be on cpu"
}


class PreflightError(RuntimeError):
    """The target device cannot even allocate a tensor; a sweep would be meaningless."""


# --------------------------------------------------------------------------------------------------
# op list


def device_type_of(device: str) -> str:
    """'neuron:0' -> 'neuron', without torch.device (which rejects 'neuron' until the backend loads)."""
    return str(device).split(":", 1)[0]


def op_id(op: Any) -> str:
    variant = getattr(op, "variant_test_name", "") or ""
    return op.name + ("." + variant if variant else "")


def load_hook(spec: str) -> Callable[[list], list]:
    """``path/to/file.py:func`` or ``package.module:func``."""
    target, sep, func = spec.rpartition(":")
    if not sep or not target or not func:
        raise ValueError(f"--ops-hook must look like FILE.py:FUNC or MODULE:FUNC, got {spec!r}")
    if target.endswith(".py") or os.sep in target:
        path = Path(target).resolve()
        mod_spec = importlib.util.spec_from_file_location(f"_opinfo_sweep_hook_{path.stem}", path)
        if mod_spec is None or mod_spec.loader is None:
            raise ImportError(f"cannot load hook file {path}")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, func)


def load_ops(hook: str | None = None, only: Sequence[str] | None = None) -> list:
    """op_db (after the hook, if any), optionally restricted to the op ids in ``only`` (in op_db order)."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = list(op_db)
    if hook:
        ops = list(load_hook(hook)(ops))
    if only:
        wanted = set(only)
        unknown = wanted - {op_id(op) for op in ops}
        if unknown:
            raise KeyError(f"unknown op ids: {sorted(unknown)}")
        ops = [op for op in ops if op_id(op) in wanted]
    return ops


def chunk_of(items: Sequence, chunk: int, nchunks: int) -> list:
    """Interleaved split (item k goes to chunk k % nchunks): spreads op families over the chunks."""
    if not 0 <= chunk < nchunks:
        raise ValueError(f"chunk {chunk} not in [0, {nchunks})")
    return [item for k, item in enumerate(items) if k % nchunks == chunk]


def is_random_op(op: Any) -> bool:
    name = op.name
    if name in _NOT_RANDOM or op_id(op) in _NOT_RANDOM or name.startswith("__"):  # __rand__ etc.
        return False
    return bool(_RANDOM_WORDS.search(name))


def is_shape_only(op: Any) -> bool:
    """Randomness or uninitialized memory: only shape/dtype/device can be compared."""
    return (
        is_random_op(op)
        or bool(getattr(op, "has_nondeterministic_output", False))
        or op.name in _UNINITIALIZED
    )


def op_tolerance(op: Any, device_type: str) -> tuple[float, float]:
    """(atol, rtol): the float32 default, loosened by the op's float32 ``toleranceOverride``s that are
    not specific to another device type or to unrelated test suites."""
    atol, rtol = DEFAULT_ATOL, DEFAULT_RTOL
    try:
        from torch.testing._internal.common_device_type import toleranceOverride
    except Exception:  # pragma: no cover - torch internals moved
        return atol, rtol
    for deco in getattr(op, "decorators", ()) or ():
        inner = getattr(deco, "decorators", None)
        inner = inner if inner is not None else [deco]
        dev = getattr(deco, "device_type", None)
        if dev not in (None, "cpu", device_type):
            continue
        if getattr(deco, "cls_name", None) not in (None, "TestCommon", "TestConsistency"):
            continue
        dtypes = getattr(deco, "dtypes", None)
        if dtypes is not None and DTYPE not in dtypes:
            continue
        for d in inner:
            if isinstance(d, toleranceOverride) and DTYPE in d.d:
                atol = max(atol, d.d[DTYPE].atol)
                rtol = max(rtol, d.d[DTYPE].rtol)
    return atol, rtol


# --------------------------------------------------------------------------------------------------
# pytrees of sample arguments / outputs


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)


def _is_cpu_device_spec(obj: Any) -> bool:
    if isinstance(obj, torch.device):
        return obj.type == "cpu"
    return isinstance(obj, str) and (obj == "cpu" or obj.startswith("cpu:"))


def _move_tensor(t: torch.Tensor, device: str, memo: dict[Any, Any]) -> torch.Tensor:
    """Copy ``t`` to ``device``.  A contiguous tensor that owns its whole storage is copied plainly;
    any other (a strided/expanded/offset view, as OpInfo's noncontiguous samples are) is rebuilt on
    the device as the same view of a copy of its whole storage, so the device sees the same strides,
    offset and aliasing as the CPU (views of one storage share one device storage)."""
    if t.layout != torch.strided or t.is_quantized:
        return t.detach().to(device, copy=True)
    itemsize = t.element_size()
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    key = ("storage", storage.data_ptr(), nbytes, t.dtype)
    owns_storage = t.is_contiguous() and t.storage_offset() == 0 and nbytes == t.numel() * itemsize
    if nbytes % itemsize or (owns_storage and storage.data_ptr() not in memo.get("shared", ())):
        return t.detach().to(device, copy=True)
    if key not in memo:
        with torch.no_grad():
            flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (nbytes // itemsize,), (1,))
            memo[key] = flat.to(device, copy=True)
    view = memo[key].as_strided(t.shape, t.stride(), t.storage_offset())
    if t.is_conj():  # the storage copy holds the un-conjugated bytes: keep the math bits of the view
        view = view.conj()
    if t.is_neg():
        view = view._neg_view()
    return view


def to_device(obj: Any, device: str, memo: dict[Any, Any] | None = None) -> Any:
    """Copy every tensor in ``obj`` to ``device`` (always a copy, so CPU and device runs never share
    storage; the same tensor object maps to the same copy); re-point 'cpu' device arguments."""
    if memo is None:
        seen: set[int] = set()
        shared: set[int] = set()
        for t in iter_tensors(obj):
            if t.layout == torch.strided and not t.is_quantized and t.untyped_storage().nbytes():
                ptr = t.untyped_storage().data_ptr()
                (shared if ptr in seen else seen).add(ptr)
        memo = {"shared": shared}
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = _move_tensor(obj, device, memo)
        return memo[id(obj)]
    if _is_cpu_device_spec(obj):
        return torch.device(device) if isinstance(obj, torch.device) else device
    if isinstance(obj, list):
        return [to_device(x, device, memo) for x in obj]
    if isinstance(obj, tuple):
        items = [to_device(x, device, memo) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: to_device(v, device, memo) for k, v in obj.items()}
    return obj


def _is_dense(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_quantized


def describe(obj: Any, limit: int = 240) -> str:
    """Short description of sample arguments with tensors shown as T[shape]."""

    def fmt(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            dt = "" if x.dtype == DTYPE else "," + str(x.dtype).replace("torch.", "")
            return f"T{list(x.shape)}{dt}"
        if isinstance(x, list):
            return "[" + ", ".join(fmt(y) for y in x) + "]"
        if isinstance(x, tuple):
            return "(" + ", ".join(fmt(y) for y in x) + ("," if len(x) == 1 else "") + ")"
        if isinstance(x, dict):
            return "{" + ", ".join(f"{k}={fmt(v)}" for k, v in x.items()) + "}"
        return repr(x)

    s = fmt(obj)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _short(exc: BaseException, limit: int = MSG_LIMIT) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip()
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def compare(
    expected: Any,
    actual: Any,
    device_type: str,
    atol: float,
    rtol: float,
    shape_only: bool,
    path: str = "out",
) -> str | None:
    """None if ``actual`` (device run) matches ``expected`` (CPU run), else a message."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{path}: expected a Tensor, got {type(actual).__name__}"
        if actual.device.type != device_type:
            return f"{path}: on device {actual.device}, expected device type {device_type!r}"
        if actual.dtype != expected.dtype:
            return f"{path}: dtype {actual.dtype}, expected {expected.dtype}"
        if actual.shape != expected.shape:
            return f"{path}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        if shape_only:
            return None
        try:
            torch.testing.assert_close(
                actual.detach().cpu(),
                expected.detach(),
                atol=atol,
                rtol=rtol,
                equal_nan=True,
                check_device=False,
                check_stride=False,
                check_layout=False,
            )
        except AssertionError as exc:
            return f"{path}: {str(exc).strip()}"
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)):
            return f"{path}: expected a {type(expected).__name__}, got {type(actual).__name__}"
        if len(actual) != len(expected):
            return f"{path}: length {len(actual)}, expected {len(expected)}"
        for k, (e, a) in enumerate(zip(expected, actual)):
            msg = compare(e, a, device_type, atol, rtol, shape_only, f"{path}[{k}]")
            if msg:
                return msg
        return None
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            return f"{path}: dict keys differ"
        for k in expected:
            msg = compare(expected[k], actual[k], device_type, atol, rtol, shape_only, f"{path}[{k!r}]")
            if msg:
                return msg
        return None
    if isinstance(actual, torch.Tensor):
        return f"{path}: expected {type(expected).__name__}, got a Tensor"
    if isinstance(expected, int):  # bool included
        if shape_only:
            return None if type(actual) is type(expected) else f"{path}: type {type(actual).__name__}"
        return None if actual == expected else f"{path}: {actual!r} != expected {expected!r}"
    if isinstance(expected, (float, complex)):
        if not isinstance(actual, (int, float, complex)) or isinstance(actual, bool):
            return f"{path}: expected a number, got {type(actual).__name__}"
        if shape_only:
            return None
        try:
            torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True,
                                       check_dtype=False)
        except AssertionError as exc:
            return f"{path}: {str(exc).strip()}"
        return None
    try:
        same = bool(actual == expected)
    except Exception:
        same = repr(actual) == repr(expected)
    return None if same else f"{path}: {actual!r} != expected {expected!r}"


# --------------------------------------------------------------------------------------------------
# running one op (in-process)


def _sample_args(sample: Any) -> list:
    return [sample.input, sample.args, sample.kwargs]


def _call(op: Any, args: list) -> Any:
    inp, a, kw = args
    return op(inp, *a, **kw)


def run_sample(op: Any, sample: Any, device: str, atol: float, rtol: float, shape_only: bool,
               on_phase: Callable[[str], None] | None = None) -> tuple[str, str]:
    """('pass'|'fail'|'error'|'skip', message) for one sample.  ``on_phase('cpu'|'device')`` is
    called before each run (the child logs it, so a crash can be pinned to a sample and a side)."""
    note = on_phase or (lambda phase: None)
    dev_type = device_type_of(device)
    cpu_args = _sample_args(sample)
    if not all(_is_dense(t) for t in iter_tensors(cpu_args)):
        return "skip", "non-strided input"
    move_error = None
    try:  # copy before the CPU run, which may modify the sample in place
        dev_args = to_device(cpu_args, device)
        for pos in _CPU_ARGS.get(op.name, ()):
            if pos < len(cpu_args[1]) and isinstance(cpu_args[1][pos], torch.Tensor):
                dev_args[1] = type(dev_args[1])(
                    cpu_args[1][pos].clone() if k == pos else a for k, a in enumerate(dev_args[1]))
    except Exception as exc:
        move_error = exc
    try:
        note("cpu")
        expected = _call(op, cpu_args)
    except Exception as exc:
        return "skip", "cpu: " + _short(exc)
    if move_error is not None:
        return "error", "moving the sample to the device: " + _short(move_error)
    if not all(_is_dense(t) for t in iter_tensors(expected)):
        return "skip", "non-strided output"
    try:
        note("device")
        actual = _call(op, dev_args)
        note("compare")
        # A factory sample with no tensor and no device argument (e.g. arange(2)) never touches the
        # device: its result is a CPU tensor on both sides, so only the values are compared.
        host_only = not any(True for _ in iter_tensors(cpu_args)) and "device" not in cpu_args[2]
        msg = compare(expected, actual, "cpu" if host_only else dev_type, atol, rtol, shape_only, "out")
        if msg is None:  # in-place updates of the sample's tensors (non-tensor args are not compared)
            for k, (e, a) in enumerate(zip(iter_tensors(cpu_args), iter_tensors(dev_args))):
                msg = compare(e, a, a.device.type, atol, rtol, shape_only, f"sample tensor {k}")
                if msg:
                    msg += " (after the call: in-place update differs)"
                    break
    except Exception as exc:
        return "error", _short(exc)
    return ("fail", msg) if msg else ("pass", "")


def _skip(oid: str, reason: str, **extra: Any) -> dict:
    rec = {"op": oid, "status": "skip", "passed": 0, "total": 0, "message": reason}
    rec.update(extra)
    return rec


def run_op(op: Any, device: str, max_samples: int = DEFAULT_MAX_SAMPLES, seed: int = 0,
           on_sample: Callable[[int, str, str], None] | None = None) -> dict:
    """Result record for one OpInfo: op, status, passed, total (runnable samples), message, ...
    ``on_sample(k, phase, description)`` is called before the cpu and the device run of sample k."""
    oid = op_id(op)
    t0 = time.perf_counter()
    try:
        supported = op.supported_dtypes("cpu")
    except Exception as exc:
        return _skip(oid, "supported_dtypes('cpu') failed: " + _short(exc))
    if DTYPE not in supported:
        return _skip(oid, "float32 not supported on cpu")
    if op.name.startswith("sparse.") or "to_sparse" in op.name:
        return _skip(oid, "sparse layout op")

    torch.manual_seed(seed)
    samples: list = []
    gen_note = ""
    try:
        for sample in itertools.islice(op.sample_inputs("cpu", DTYPE, requires_grad=False), max_samples):
            samples.append(sample)
    except Exception as exc:
        if not samples:
            return _skip(oid, "cpu sample generation failed: " + _short(exc))
        gen_note = f"sample generation stopped after {len(samples)}: " + _short(exc, 200)
    if not samples:
        return _skip(oid, "no float32 samples")

    atol, rtol = op_tolerance(op, device_type_of(device))
    shape_only = is_shape_only(op)
    counts = dict.fromkeys(("pass", "fail", "error", "skip"), 0)
    first: dict[str, str] = {}
    for k, sample in enumerate(samples):
        torch.manual_seed(seed + k)
        on_phase = None
        if on_sample is not None:
            desc = describe(_sample_args(sample))
            on_phase = lambda phase, k=k, desc=desc: on_sample(k, phase, desc)
        status, msg = run_sample(op, sample, device, atol, rtol, shape_only, on_phase)
        counts[status] += 1
        if status != "pass" and status not in first:
            first[status] = f"sample {k} {describe(_sample_args(sample))}: {msg}"
    runnable = counts["pass"] + counts["fail"] + counts["error"]
    rec: dict[str, Any] = {
        "op": oid,
        "passed": counts["pass"],
        "total": runnable,
        "samples": len(samples),
        "skipped_samples": counts["skip"],
        "failed_samples": counts["fail"],
        "errored_samples": counts["error"],
        "shape_only": shape_only,
        "atol": atol,
        "rtol": rtol,
    }
    if runnable == 0:
        rec.update(status="skip", message=f"cpu raised/skipped on all {len(samples)} samples: "
                   + first.get("skip", ""))
    elif counts["error"]:
        rec.update(status="error", message=first["error"])
    elif counts["fail"]:
        rec.update(status="fail", message=first["fail"])
    else:
        rec.update(status="pass", message="")
    if gen_note:
        rec["note"] = gen_note
    rec["message"] = rec["message"][:MSG_LIMIT]
    rec["time_s"] = round(time.perf_counter() - t0, 4)
    return rec


def run_ops(ops: Iterable, device: str, max_samples: int = DEFAULT_MAX_SAMPLES,
            on_start: Callable[[str], None] | None = None,
            on_result: Callable[[dict], None] | None = None,
            on_sample: Callable[[int, str, str], None] | None = None) -> list[dict]:
    """Run ops sequentially in this process (no crash isolation)."""
    results = []
    for op in ops:
        oid = op_id(op)
        if on_start:
            on_start(oid)
        try:
            rec = run_op(op, device, max_samples, on_sample=on_sample)
        except Exception as exc:  # a harness bug must not hide the rest of the chunk
            rec = {"op": oid, "status": "error", "passed": 0, "total": 0,
                   "message": "harness: " + _short(exc) + "\n" + traceback.format_exc()[-800:]}
        if on_result:
            on_result(rec)
        results.append(rec)
    return results


# --------------------------------------------------------------------------------------------------
# child process


def _prepare_process(device: str, preload: Sequence[str]) -> None:
    import faulthandler
    import warnings

    faulthandler.enable()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    for mod in preload:
        importlib.import_module(mod)


def default_preload(device: str) -> list[str]:
    return ["torchneuron_lab"] if device_type_of(device) == "neuron" else []


def child_main(args: argparse.Namespace) -> int:
    _prepare_process(args.device, args.preload)
    progress_path = Path(args.progress or (str(args.out) + ".progress"))
    with open(progress_path, "a", buffering=1) as progress:

        def emit(event: dict) -> None:
            progress.write(json.dumps(event) + "\n")
            progress.flush()

        all_ops = load_ops(args.ops_hook, _split_list(args.only))
        index = {op_id(op): k for k, op in enumerate(all_ops)}
        if args.ops_file:
            wanted = set(json.loads(Path(args.ops_file).read_text()))
            ops = [op for op in all_ops if op_id(op) in wanted]
        else:
            ops = chunk_of(all_ops, args.chunk, args.nchunks)
        emit({"event": "plan", "ops": [op_id(op) for op in ops],
              "index": [index[op_id(op)] for op in ops], "pid": os.getpid()})

        def on_result(rec: dict) -> None:
            rec["index"] = index[rec["op"]]
            emit({"event": "result", "result": rec})

        results = run_ops(
            ops, args.device, args.max_samples,
            on_start=lambda oid: emit({"event": "start", "op": oid, "t": time.time()}),
            on_result=on_result,
            on_sample=lambda k, phase, desc: emit({"event": "sample", "k": k, "phase": phase,
                                                   "desc": desc}),
        )
        if args.out:
            tmp = Path(str(args.out) + ".tmp")
            tmp.write_text(json.dumps({"device": args.device, "results": results}))
            os.replace(tmp, args.out)
        emit({"event": "end"})
    return 0


# --------------------------------------------------------------------------------------------------
# driver


@dataclasses.dataclass
class SweepConfig:
    device: str = "cpu"
    workers: int = DEFAULT_WORKERS
    nchunks: int | None = None
    max_samples: int = DEFAULT_MAX_SAMPLES
    timeout_s: float = DEFAULT_TIMEOUT_S
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    only: list[str] | None = None
    ops_hook: str | None = None
    preload: list[str] | None = None
    workdir: str | None = None
    verbose: bool = True


def _child_env(device: str = "cpu", preload: Sequence[str] = ()) -> dict[str, str]:
    env = dict(os.environ)
    if device_type_of(device) == "cpu" and not preload:
        # cpu-vs-cpu needs no device backend: do not let torch autoload one (entry point
        # torch.backends) into the children, so the harness works even while a backend is broken
        env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    # a source checkout of torchneuron_lab is importable even when not pip-installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _signal_name(rc: int) -> str:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


_CRASH_MARKERS = ("Fatal Python error", "terminate called", "Segmentation fault", "Aborted",
                  "AddressSanitizer", "Traceback (most recent call last)")


def _tail(path: Path, lines: int = 20, limit: int = 1500) -> str:
    """The informative part of a dead child's output: from the first crash marker (faulthandler's
    'Fatal Python error', a C++ 'terminate called ...', a traceback) on, else the last lines;
    faulthandler's long 'Extension modules: ...' line is dropped."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    all_lines = [ln for ln in text.strip().splitlines()
                 if ln.strip() and not ln.startswith("Extension modules:")
                 and not ln.lstrip().startswith("<frozen ")]
    start = next((k for k, ln in enumerate(all_lines) if any(m in ln for m in _CRASH_MARKERS)), None)
    picked = all_lines[start:start + lines] if start is not None else all_lines[-lines:]
    out = "\n".join(picked)
    return out if len(out) <= limit else out[: limit - 3] + "..."


class _Progress:
    """Incremental reader of a child's progress file."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.buf = ""
        self.plan: list[str] | None = None
        self.index: dict[str, int] = {}
        self.results: dict[str, dict] = {}
        self.current: str | None = None
        self.current_t = 0.0
        self.sample: dict | None = None  # the last 'sample' event of the current op
        self.ended = False
        self.last_event_t = time.time()

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return
        self.buf += data
        *lines, self.buf = self.buf.split("\n")
        if lines:
            self.last_event_t = time.time()
        for line in lines:
            if not line.strip():
                continue
            ev = json.loads(line)
            kind = ev["event"]
            if kind == "plan":
                self.plan = ev["ops"]
                self.index = dict(zip(ev["ops"], ev.get("index", ())))
            elif kind == "start":
                self.current, self.current_t = ev["op"], ev["t"]
                self.sample = None
            elif kind == "sample":
                self.sample = ev
            elif kind == "result":
                rec = ev["result"]
                self.results[rec["op"]] = rec
                if self.current == rec["op"]:
                    self.current = None
            elif kind == "end":
                self.ended = True


class _Driver:
    def __init__(self, cfg: SweepConfig, workdir: Path):
        self.cfg = cfg
        self.workdir = workdir
        self.preload = cfg.preload if cfg.preload is not None else default_preload(cfg.device)
        self.lock = threading.Lock()
        self.results: list[dict] = []
        self.attempts = 0
        self.procs: set[subprocess.Popen] = set()

    def log(self, msg: str) -> None:
        if self.cfg.verbose:
            print(msg, file=sys.stderr, flush=True)

    def base_cmd(self) -> list[str]:
        cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--device", self.cfg.device,
               "--max-samples", str(self.cfg.max_samples), "--preload", ",".join(self.preload)]
        if self.cfg.ops_hook:
            cmd += ["--ops-hook", self.cfg.ops_hook]
        if self.cfg.only:
            cmd += ["--only", ",".join(self.cfg.only)]
        return cmd

    def run_chunk(self, chunk: int, nchunks: int) -> None:
        remaining: list[str] | None = None  # None: the whole chunk, as the child computes it
        index: dict[str, int] = {}  # op id -> position in the op list, from the children's plans
        attempt = 0
        while True:
            tag = f"c{chunk:03d}a{attempt:02d}"
            out = self.workdir / f"{tag}.json"
            progress_path = self.workdir / f"{tag}.progress"
            stderr_path = self.workdir / f"{tag}.log"
            cmd = self.base_cmd() + ["--out", str(out), "--progress", str(progress_path)]
            if remaining is None:
                cmd += ["--chunk", str(chunk), "--nchunks", str(nchunks)]
            else:
                ops_file = self.workdir / f"{tag}.ops.json"
                ops_file.write_text(json.dumps(remaining))
                cmd += ["--ops-file", str(ops_file)]
            rc, prog, timed_out = self._spawn(cmd, progress_path, stderr_path)
            with self.lock:
                self.attempts += 1
            records = list(prog.results.values())
            if rc == 0 and out.exists():
                records = json.loads(out.read_text())["results"]
                self._add(records)
                return
            self._add(records)
            index.update(prog.index)
            plan = prog.plan if prog.plan is not None else remaining
            done = {r["op"] for r in records}
            tail = _tail(stderr_path)
            if prog.current is not None:
                culprit = prog.current
                where = "in sample setup"
                if prog.sample is not None:
                    sm = prog.sample
                    where = f"in the {sm['phase']} run of sample {sm['k']} {sm['desc']}"
                if timed_out == "op":
                    rec = {"op": culprit, "status": "error", "passed": 0, "total": 0,
                           "message": f"timeout: op still running after {self.cfg.timeout_s:g} s, "
                                      f"{where} (child killed)"}
                    self.log(f"[opinfo] {culprit}: timeout")
                else:
                    rec = {"op": culprit, "status": "crash", "passed": 0, "total": 0,
                           "message": f"child died ({_signal_name(rc)}) {where}; "
                                      f"stderr tail:\n{tail}"}
                    self.log(f"[opinfo] {culprit}: crash ({_signal_name(rc)})")
                if culprit in index:
                    rec["index"] = index[culprit]
                self._add([rec])
                done.add(culprit)
            else:
                if prog.plan is None:
                    where = "startup"
                elif plan is not None and done >= set(plan):
                    where = "exit"
                else:
                    where = "between ops"
                pseudo = f"<chunk {chunk} attempt {attempt} {where}>"
                if timed_out:
                    self._add([{"op": pseudo, "status": "error", "passed": 0, "total": 0,
                                "message": f"timeout: child silent outside any op for "
                                           f"{self.cfg.startup_timeout_s:g} s (killed); output tail:\n"
                                           f"{tail}"}])
                    self.log(f"[opinfo] chunk {chunk}: child hung at {where}, killed")
                else:
                    self._add([{"op": pseudo, "status": "crash", "passed": 0, "total": 0,
                                "message": f"child died ({_signal_name(rc)}) outside any op "
                                           f"(out file {'present' if out.exists() else 'missing'}); "
                                           f"stderr tail:\n{tail}"}])
                    self.log(f"[opinfo] chunk {chunk}: child died ({_signal_name(rc)}) at {where}")
                if not prog.results and plan is not None:
                    # no progress in this attempt: do not loop; the rest of the chunk is not run
                    self._add([{"op": oid, "status": "error", "passed": 0, "total": 0,
                                "message": f"not run: child failed outside any op ({pseudo})",
                                **({"index": index[oid]} if oid in index else {})}
                               for oid in plan if oid not in done])
                    return
            if plan is None:
                return
            remaining = [oid for oid in plan if oid not in done]
            if not remaining:
                return
            attempt += 1

    def _spawn(self, cmd: list[str], progress_path: Path,
               stderr_path: Path) -> tuple[int, _Progress, str | None]:
        """Run one child to its end; (returncode, progress, None | 'op' | 'idle' when killed)."""
        prog = _Progress(progress_path)
        timed_out: str | None = None
        with open(stderr_path, "w") as errf:
            proc = subprocess.Popen(cmd, stdout=errf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=_child_env(self.cfg.device, self.preload), cwd=str(REPO_ROOT),
                                    start_new_session=True)
            with self.lock:
                self.procs.add(proc)
            try:
                while True:
                    try:
                        rc = proc.wait(timeout=0.2)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    prog.poll()
                    now = time.time()
                    if prog.current is not None and now - prog.current_t > self.cfg.timeout_s:
                        timed_out = "op"
                    elif prog.current is None and now - prog.last_event_t > self.cfg.startup_timeout_s:
                        timed_out = "idle"
                    if timed_out:
                        _kill(proc)
                        rc = proc.wait()
                        break
            finally:
                if proc.poll() is None:
                    _kill(proc)
                    proc.wait()
                with self.lock:
                    self.procs.discard(proc)
        prog.poll()
        return rc, prog, timed_out

    def _add(self, records: list[dict]) -> None:
        with self.lock:
            self.results.extend(records)

    def kill_all(self) -> None:
        with self.lock:
            procs = list(self.procs)
        for proc in procs:
            _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (the child was started in its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def preflight(device: str, preload: Sequence[str],
              timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
    """Check in a child process that the preload modules import and ``device`` can hold a tensor."""
    code = (
        "import importlib, sys, torch\n"
        "for m in sys.argv[2:]: importlib.import_module(m)\n"
        "t = torch.arange(4.0).to(sys.argv[1])\n"
        "assert t.device.type == torch.device(sys.argv[1]).type, t.device\n"
        "assert (t + 1).cpu().tolist() == [1.0, 2.0, 3.0, 4.0]\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code, device, *preload],
                              env=_child_env(device, preload),
                              cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        raise PreflightError(f"device {device!r}: preflight timed out after {timeout_s:g} s") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise PreflightError(
            f"device {device!r} is not usable (preload {list(preload)}; {_signal_name(proc.returncode)}):"
            f"\n{tail}")


def summarize(results: list[dict]) -> dict:
    counts = dict.fromkeys(STATUSES, 0)
    for rec in results:
        counts[rec["status"]] += 1
    runnable = counts["pass"] + counts["fail"] + counts["error"] + counts["crash"]
    rate = 100.0 * counts["pass"] / runnable if runnable else None
    return {"ops": len(results), **counts, "runnable": runnable, "pass_rate": rate,
            "samples": sum(r.get("total", 0) for r in results),
            "samples_passed": sum(r.get("passed", 0) for r in results)}


def summary_line(summary: dict) -> str:
    rate = "n/a" if summary["pass_rate"] is None else f"{summary['pass_rate']:.1f}%"
    return (f"opinfo: {summary['ops']} ops, {summary['pass']} pass, {summary['fail']} fail, "
            f"{summary['error']} error, {summary['crash']} crash, {summary['skip']} skip; "
            f"pass rate {rate} of runnable (pass/(pass+fail+error+crash))")


def run_sweep(cfg: SweepConfig) -> dict:
    """Run the crash-isolated sweep; returns the report dict (not written anywhere)."""
    t0 = time.perf_counter()
    drv_preload = cfg.preload if cfg.preload is not None else default_preload(cfg.device)
    if device_type_of(cfg.device) != "cpu" or drv_preload:
        preflight(cfg.device, drv_preload, cfg.startup_timeout_s)
    workers = max(1, cfg.workers)
    if cfg.nchunks:
        nchunks = cfg.nchunks
    elif cfg.only:  # a short explicit list: one chunk per worker
        nchunks = max(1, min(workers, len(cfg.only)))
    else:
        nchunks = workers * DEFAULT_CHUNKS_PER_WORKER
    tmp = None
    if cfg.workdir:
        workdir = Path(cfg.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="opinfo_sweep_")
        workdir = Path(tmp.name)
    drv = _Driver(cfg, workdir)
    jobs: queue.Queue[int] = queue.Queue()
    for chunk in range(nchunks):
        jobs.put(chunk)
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            try:
                chunk = jobs.get_nowait()
            except queue.Empty:
                return
            t = time.perf_counter()
            try:
                drv.run_chunk(chunk, nchunks)
            except BaseException as exc:  # surfaces in the main thread
                errors.append(exc)
                return
            drv.log(f"[opinfo] chunk {chunk + 1}/{nchunks} done in {time.perf_counter() - t:.1f} s")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(workers, nchunks))]
    try:
        for th in threads:
            th.start()
        for th in threads:
            while th.is_alive():
                th.join(0.5)
    finally:
        drv.kill_all()
        if tmp is not None:
            tmp.cleanup()
    if errors:
        raise errors[0]

    by_op: dict[str, dict] = {}
    for rec in drv.results:
        by_op[rec["op"]] = rec
    results = sorted(by_op.values(), key=lambda r: (r.get("index", math.inf), r["op"]))
    summary = summarize(results)
    wall = time.perf_counter() - t0
    return {
        "device": cfg.device,
        "summary": summary,
        "summary_line": summary_line(summary),
        "wall_time_s": round(wall, 2),
        "config": {
            "workers": workers, "nchunks": nchunks, "max_samples": cfg.max_samples,
            "timeout_s": cfg.timeout_s, "startup_timeout_s": cfg.startup_timeout_s,
            "only": cfg.only, "ops_hook": cfg.ops_hook,
            "preload": drv.preload, "child_processes": drv.attempts,
            "default_atol": DEFAULT_ATOL, "default_rtol": DEFAULT_RTOL,
        },
        "torch_version": torch.__version__,
        "python": sys.version.split()[0],
        "results": results,
    }


def report_paths(report: str | os.PathLike | None, device: str) -> tuple[Path, Path]:
    """(json, md) for --report: a stem, or a path ending in .json/.md; default reports/opinfo_<dev>."""
    if report is None:
        stem = REPO_ROOT / "reports" / f"opinfo_{device.replace(':', '_')}"
    else:
        stem = Path(report)
        if stem.suffix in (".json", ".md"):
            stem = stem.with_suffix("")
    return stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".md")


def _md_cell(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.replace("|", "\\|")


def render_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"# OpInfo conformance: device `{report['device']}` vs cpu",
        "",
        f"**{report['summary_line']}**",
        "",
        (f"- torch {report['torch_version']}, python {report['python']}; float32 samples, at most "
         f"{cfg['max_samples']} per op; per-op timeout {cfg['timeout_s']:g} s"),
        (f"- {report['summary']['samples_passed']}/{report['summary']['samples']} runnable samples "
         f"passed; {cfg['workers']} workers, {cfg['nchunks']} chunks, {cfg['child_processes']} child "
         f"processes; wall time {report['wall_time_s']:.1f} s"),
        (f"- default tolerance atol={cfg['default_atol']:g} rtol={cfg['default_rtol']:g} (looser "
         f"float32 toleranceOverride of the op if any), equal_nan; random/uninitialized ops: "
         f"shape/dtype/device only"),
        "",
        "| op | status | samples passed/total | message |",
        "| --- | --- | --- | --- |",
    ]
    ordered = sorted(report["results"], key=lambda r: (_SEVERITY[r["status"]], r.get("index", math.inf)))
    for rec in ordered:
        total = rec.get("total", 0)
        samples = f"{rec.get('passed', 0)}/{total}" if rec["status"] != "skip" or total else "-"
        lines.append(f"| `{rec['op']}` | {rec['status']} | {samples} | {_md_cell(rec.get('message', ''))} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, report_path: str | os.PathLike | None = None) -> tuple[Path, Path]:
    json_path, md_path = report_paths(report_path, report["device"])
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path.write_text(render_markdown(report))
    return json_path, md_path


# --------------------------------------------------------------------------------------------------
# CLI


def _split_list(value: str | None) -> list[str] | None:
    if not value:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tests.conformance.opinfo_sweep",
        description="OpInfo float32 conformance sweep: target device vs cpu, crash-isolated.",
    )
    p.add_argument("--device", default="neuron", help="target device (default: neuron)")
    p.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES,
                   help=f"samples per op (default {DEFAULT_MAX_SAMPLES})")
    p.add_argument("--only", help="comma-separated op ids to sweep (default: all of op_db)")
    p.add_argument("--ops-hook", help="FILE.py:FUNC or MODULE:FUNC; FUNC(ops) returns the op list")
    p.add_argument("--preload", default=None,
                   help="comma-separated modules the children import first "
                        "(default: torchneuron_lab for device neuron, none otherwise)")
    p.add_argument("--list", action="store_true", help="print the op ids and exit")
    d = p.add_argument_group("driver")
    d.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="parallel children (default 2)")
    d.add_argument("--nchunks", type=int, default=None,
                   help=f"op chunks (default {DEFAULT_CHUNKS_PER_WORKER} per worker)")
    d.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"per-op timeout in seconds (default {DEFAULT_TIMEOUT_S:g})")
    d.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S,
                   help="kill a child silent this long outside any op (backend import/build, exit); "
                        f"also the device preflight's limit (default {DEFAULT_STARTUP_TIMEOUT_S:g})")
    d.add_argument("--report", help="report path stem (writes STEM.json and STEM.md); "
                                    "default reports/opinfo_<device>")
    d.add_argument("--workdir", help="keep the children's progress files and logs here")
    d.add_argument("--fail-under", type=float, default=None,
                   help="exit 1 if any crash or the pass rate is below this percentage")
    d.add_argument("--quiet", action="store_true")
    c = p.add_argument_group("child (one chunk, in-process)")
    c.add_argument("--chunk", type=int, default=None, help="run chunk i of --nchunks in this process")
    c.add_argument("--ops-file", help="run the op ids listed (JSON) in this file in this process")
    c.add_argument("--out", help="child result file (JSON)")
    c.add_argument("--progress", help="child progress file (JSON lines; default OUT.progress)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    preload = _split_list(args.preload) if args.preload is not None else default_preload(args.device)
    args.preload = preload or []
    if args.list:
        for op in load_ops(args.ops_hook, _split_list(args.only)):
            print(op_id(op))
        return 0
    if args.chunk is not None or args.ops_file:
        if args.chunk is not None and not args.nchunks:
            build_parser().error("--chunk needs --nchunks")
        if not args.out and not args.progress:
            build_parser().error("child mode needs --out (or --progress)")
        return child_main(args)

    cfg = SweepConfig(device=args.device, workers=args.workers, nchunks=args.nchunks,
                      max_samples=args.max_samples, timeout_s=args.timeout,
                      startup_timeout_s=args.startup_timeout, only=_split_list(args.only),
                      ops_hook=args.ops_hook, preload=args.preload, workdir=args.workdir,
                      verbose=not args.quiet)
    try:
        report = run_sweep(cfg)
    except PreflightError as exc:
        print(f"opinfo: preflight failed: {exc}", file=sys.stderr)
        return 2
    report["command"] = " ".join(shlex.quote(a) for a in [sys.executable, "-m",
                                                          "tests.conformance.opinfo_sweep",
                                                          *(argv if argv is not None else sys.argv[1:])])
    json_path, md_path = write_report(report, args.report)
    print(report["summary_line"])
    print(f"opinfo: wall time {report['wall_time_s']:.1f} s; report {md_path} and {json_path}")
    s = report["summary"]
    if args.fail_under is not None and (s["crash"] or (s["pass_rate"] or 0.0) < args.fail_under):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
