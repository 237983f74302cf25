"""The launch fast path for the hottest eager ops (add/sub/mul Tensor, add_/sub_/mul_/div_ Tensor on dense
same-shape floating tensors or a tensor and a Python number; `kernels.cpp` "Launch fast path") and the
pointwise full-overlap rule of the general path (an op whose output is exactly an input launches).

The fast path must be indistinguishable from the general path: the same results (bit for bit against
CPU), the same errors, the same stream order, signatures and memory statistics.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

import torchneuron_lab  # noqa: F401  (registers the device)
from torchneuron_lab.compiler import signatures
from torchneuron_lab.device import recorder
from torchneuron_lab.device._backend import lib

from _neuron_child import run_child

C = lib()
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _drained() -> Iterator[None]:
    torch.neuron.synchronize(0)
    yield
    torch.neuron.set_stream(torch.neuron.default_stream(0))
    torch.neuron.synchronize(0)


def _pair(dtype: torch.dtype, shape: tuple[int, ...] = (33, 17)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype).abs() + 0.5


CALLS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": lambda a, b: a + b,
    "add_alpha": lambda a, b: torch.add(a, b, alpha=-2.5),
    "sub": lambda a, b: a - b,
    "sub_alpha": lambda a, b: torch.sub(a, b, alpha=3),
    "mul": lambda a, b: a * b,
    "add_number": lambda a, b: a + 1,
    "mul_float": lambda a, b: a * 0.3,
    "mul_bool": lambda a, b: a * True,
    "add_self": lambda a, b: a + a,
    "iadd": lambda a, b: a.add_(b),
    "iadd_alpha": lambda a, b: a.add_(b, alpha=0.5),
    "isub": lambda a, b: a.sub_(b),
    "imul": lambda a, b: a.mul_(b),
    "idiv": lambda a, b: a.div_(b),
    "idiv_number": lambda a, b: a.div_(7),
    "imul_self": lambda a, b: a.mul_(a),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", sorted(CALLS))
def test_fast_ops_are_bit_identical_to_cpu(name: str, dtype: torch.dtype) -> None:
    a, b = _pair(dtype)
    want = CALLS[name](a.clone(), b)
    an, bn = a.to("neuron"), b.to("neuron")
    got = CALLS[name](an, bn)
    assert got.device == torch.device("neuron", 0) and got.dtype == want.dtype and got.shape == want.shape
    assert got.is_contiguous()
    assert torch.equal(got.cpu(), want)
    if name.startswith("i"):
        assert got is an and torch.equal(an.cpu(), want)  # in place: the argument itself


def test_a_fast_launch_returns_before_its_kernel_ran_and_keeps_stream_order() -> None:
    a, b = (t.to("neuron") for t in _pair(torch.float32, (256, 256)))
    s = torch.neuron.Stream()
    with torch.neuron.stream(s):
        torch.neuron._sleep(300)
        before = C.stream_counts(0, s.stream_id)
        t0 = time.perf_counter()
        c = a + b
        c.mul_(2.0)
        d = c - a
        returned = time.perf_counter() - t0
        after = C.stream_counts(0, s.stream_id)
    assert returned < 0.1
    assert after[0] - before[0] == 3 and after[1] == before[1]  # three launches queued behind the sleep
    assert torch.neuron.default_stream().query() is True and s.query() is False
    s.synchronize()
    ac, bc = a.cpu(), b.cpu()
    assert torch.equal(d.cpu(), (ac + bc).mul_(2.0) - ac)


FALLBACK_CASES: dict[str, Callable[[torch.device], torch.Tensor]] = {
    "broadcast": lambda d: torch.ones(4, 3, device=d) + torch.arange(3.0, device=d),
    "promotion": lambda d: torch.ones(3, device=d) + torch.arange(3, device=d),
    "int": lambda d: torch.arange(6, device=d) * torch.arange(6, device=d),
    "int_number": lambda d: torch.arange(6, device=d) + 2.5,
    "complex_number": lambda d: torch.ones(3, device=d) * 1j,
    "noncontiguous": lambda d: torch.arange(12.0, device=d).view(3, 4).t() + torch.ones(4, 3, device=d),
    "zero_dim_tensor": lambda d: torch.ones(3, device=d) * torch.tensor(2.0, device=d),
    "mixed_float": lambda d: torch.ones(3, device=d, dtype=torch.float16) + torch.ones(3, device=d),
}


@pytest.mark.parametrize("name", sorted(FALLBACK_CASES))
def test_calls_outside_the_fast_path_take_the_general_path_with_cpus_result(name: str) -> None:
    want = FALLBACK_CASES[name](torch.device("cpu"))
    got = FALLBACK_CASES[name](torch.device("neuron"))
    assert got.dtype == want.dtype and got.stride() == want.stride()
    assert torch.equal(got.cpu(), want)


def test_errors_are_cpus() -> None:
    a = torch.arange(8.0, device="neuron")
    with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to tensor"):
        a[1:].add_(a[:-1])  # partial overlap: CPU's check, at once
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="neuron") + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="neuron:0") * torch.ones(3, device="neuron:1")
    with pytest.raises(RuntimeError, match="must match the size"):
        torch.ones(3, device="neuron") + torch.ones(4, device="neuron")
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        torch.ones(3, device="neuron").add_(torch.ones(2, 3, device="neuron"))
    with pytest.raises(RuntimeError, match="Subtraction, the `-` operator, with a bool tensor is not supported"):
        torch.ones(3, device="neuron") - True
    with pytest.raises(RuntimeError, match="Boolean alpha only supported for Boolean results"):
        torch.ones(3, device="neuron").add_(torch.ones(3, device="neuron"), alpha=True)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):  # an alpha the dtype cannot hold: at the call
        h = torch.ones(4, dtype=dtype, device="neuron")
        with pytest.raises(RuntimeError, match="without overflow"):
            torch.ones(4, dtype=dtype).add_(torch.ones(4, dtype=dtype), alpha=1e300)
        with pytest.raises(RuntimeError, match="without overflow"):
            h.add_(h, alpha=1e300)
        with pytest.raises(RuntimeError, match="without overflow"):
            torch.sub(h, h, alpha=1e300)
        assert h.cpu().tolist() == [1.0] * 4
    x = torch.ones(4, device="neuron")
    x.add_(x)  # full overlap is fine, as on CPU
    assert x.cpu().tolist() == [2.0] * 4


def test_signatures_and_memory_stats_are_the_general_paths() -> None:
    signatures.clear()
    a = torch.randn(40, 24, device="neuron")
    gc.collect()  # an earlier test's garbage (tracebacks holding neuron tensors) is not freed inside this one
    torch.neuron.synchronize()
    m = signatures.mark()
    base = torch.neuron.memory_allocated()
    c = a * a  # fast path (recorder off)
    assert torch.neuron.memory_allocated() - base == 4096  # one output: 3840 B rounded up to 512 B
    assert signatures.new_since(m) == {0: ["aten::mul.Tensor(float32[40, 24], float32[40, 24])"]}
    m2 = signatures.mark()
    recorder.start(record_shapes=True)
    try:
        a * a  # recorded: the same signature, not new
        a.add_(1)
        torch.neuron.synchronize()
    finally:
        recorder.stop()
    cols = C.recorder_read()
    events = [e for e in recorder.read().events if e.kind == "kernel"]
    recorder.clear()
    assert [e.name for e in events] == ["aten::mul.Tensor", "aten::add_.Tensor"]
    assert [e.new_signature for e in events] == [False, True]
    assert signatures.new_since(m2) == {0: ["aten::add_.Tensor(float32[40, 24])"]}
    # the general path's accounting: every tensor argument read (the Python number is an 8-byte tensor),
    # the output or the written argument written; the launch span and its link to the kernel
    assert [(e.bytes_read, e.bytes_written) for e in events] == [(7680, 3840), (3848, 3840)]
    assert [e.shapes for e in events] == ["[40, 24], [40, 24]", "[40, 24]"]
    kernels = [i for i, k in enumerate(cols["kind"]) if cols["name"][i] in ("aten::mul.Tensor", "aten::add_.Tensor")]
    for i in kernels:
        assert 0 < cols["host_start_ns"][i] <= cols["host_end_ns"][i] <= cols["start_ns"][i] < cols["end_ns"][i]
        assert cols["correlation"][i] > 0 and cols["stream"][i] == 0
    del c
    assert torch.neuron.memory_allocated() == base


def _launched_behind_a_sleep(launch: Callable[[], object]) -> tuple[object, int, list[str]]:
    """Runs ``launch`` behind a 200 ms device sleep with the recorder on: what it returned, how many
    launches were still queued when it returned (the sleep included), and the sync events recorded."""
    torch.neuron.synchronize()
    recorder.start()
    try:
        torch.neuron._sleep(200)
        out = launch()
        enqueued, completed = C.stream_counts(0, 0)
        torch.neuron.synchronize()
    finally:
        recorder.stop()
    syncs = [e.name for e in recorder.read().events if e.kind == "sync"]
    recorder.clear()
    return out, enqueued - completed, syncs


def test_a_pointwise_op_writing_one_of_its_inputs_launches_without_a_host_wait() -> None:
    # mul.out(x, s, out=x) (what a foreach op's per-tensor loop calls when it is not launched as one):
    # full overlap, no host path
    xs = [torch.ones(64, 64, device="neuron") for _ in range(3)]
    for x in xs:
        torch.mul(x, 1.0, out=x)  # the first launch of each plan is checked on the host

    def launch() -> None:
        for x in xs:
            torch.mul(x, 3.0, out=x)
        torch.mul(xs[0], 2.0, out=xs[0])

    _, queued, syncs = _launched_behind_a_sleep(launch)
    assert queued == 5  # the sleep, three muls and the fourth, all queued
    assert syncs == ["sync: torch.neuron.synchronize()"]
    assert xs[0].cpu().unique().tolist() == [6.0] and xs[2].cpu().unique().tolist() == [3.0]


def test_a_kernel_whose_layout_differs_from_its_meta_kernels_launches_with_the_cpus_layout() -> None:
    # channels-last convolution (what Inductor's CPU graphs call): Meta says contiguous, mkldnn returns
    # channels-last; the first launch learns the CPU's strides, later launches are queued with them
    cl = torch.channels_last
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 16, 16, generator=g).contiguous(memory_format=cl)
    w = torch.randn(8, 3, 3, 3, generator=g).contiguous(memory_format=cl)
    b = torch.randn(8, generator=g)
    want = torch.ops.aten.convolution(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    xn, wn, bn = x.to("neuron"), w.to("neuron"), b.to("neuron")

    def conv() -> torch.Tensor:
        return torch.ops.aten.convolution(xn, wn, bn, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)

    conv()  # the first launch runs on the host and checks the plan
    got, queued, syncs = _launched_behind_a_sleep(conv)
    assert isinstance(got, torch.Tensor)
    assert queued == 2  # the sleep and the convolution, both queued
    assert syncs == ["sync: torch.neuron.synchronize()"]
    assert got.stride() == want.stride() == (2048, 1, 128, 8)
    assert torch.equal(got.cpu(), want)


def _odd(shape: tuple[int, ...], strides: tuple[int, ...], seed: int) -> torch.Tensor:
    # a dense tensor whose size-1 dims have channels-last-like strides (what adaptive_avg_pool2d(cl, 1) returns)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).as_strided(shape, strides)


def _w(*shape: int, seed: int = 11) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


_SIZE_ONE_STRIDE_CASES = {
    "conv2d channels-last to 1x1": (F.conv2d, [_odd((2, 16, 1, 1), (16, 1, 16, 16), 1), _w(8, 16, 1, 1)]),
    "conv2d 3x3 to 1x1": (F.conv2d, [_w(1, 8, 3, 3).contiguous(memory_format=torch.channels_last), _w(8, 8, 3, 3)]),
    "conv1d L=1": (F.conv1d, [_odd((2, 8, 1), (8, 1, 8), 2), _w(4, 8, 1)]),
    "conv_transpose2d": (F.conv_transpose2d, [_odd((2, 16, 1, 1), (16, 1, 16, 16), 3), _w(16, 4, 1, 1)]),
    "sdpa query length 1": (F.scaled_dot_product_attention, [_odd((2, 4, 1, 8), (32, 8, 32, 1), 4),
                                                             _w(2, 4, 6, 8), _w(2, 4, 6, 8, seed=12)]),
    "layer_norm": (lambda x: F.layer_norm(x, (8,)), [_odd((2, 1, 8), (8, 1, 1), 5)]),
    "batch_norm training": (lambda x: F.batch_norm(x, None, None, training=True),
                            [_odd((2, 16, 1, 1), (16, 1, 16, 16), 6)]),
    "interpolate bilinear": (lambda x: F.interpolate(x, size=(1, 1), mode="bilinear"),
                             [_w(2, 16, 4, 4).contiguous(memory_format=torch.channels_last)]),
    "a + 1": (lambda x: x + 1, [_odd((2, 16, 1, 1), (16, 1, 16, 16), 7)]),
    "clone": (lambda x: x.clone(), [_odd((2, 16, 1, 1), (16, 1, 16, 16), 8)]),
}


@pytest.mark.parametrize("name", list(_SIZE_ONE_STRIDE_CASES))
def test_outputs_keep_the_cpus_strides_of_size_one_dims_at_every_call(name: str) -> None:
    # Plans compared strides of dims > 1 only: the first call had the CPU kernel's strides, every later one the
    # Meta kernel's ((16, 1, 16, 16) became (16, 1, 1, 1)). Kernels choose their path by strides (a tensor's
    # suggested memory format), so a later native_batch_norm_backward gave other bits than CPU's (UperNet's
    # gradients): the strides must be CPU's at every call.
    f, args = _SIZE_ONE_STRIDE_CASES[name]
    want = f(*args)
    dev = [a.to("neuron") for a in args]
    for call in range(4):
        got = f(*dev)
        assert got.stride() == want.stride(), (call, got.stride(), want.stride())
        assert torch.equal(got.cpu(), want), call


def test_batch_norm_backward_after_a_1x1_convolution_is_cpus_at_every_call() -> None:
    x = _odd((2, 16, 1, 1), (16, 1, 16, 16), 21)
    w = _w(16, 16, 1, 1, seed=22)
    go = _w(2, 16, 1, 1, seed=23)
    mean, var, weight = _w(16, seed=24), _w(16, seed=25).abs() + 1, _w(16, seed=26)

    def step(x: torch.Tensor, w: torch.Tensor, go: torch.Tensor, *bn: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(x, w)
        return torch.ops.aten.native_batch_norm_backward(go, y, bn[2], bn[0], bn[1], None, None, False, 1e-5,
                                                         [True, True, True])[1]

    want = step(x, w, go, mean, var, weight)
    dev = [t.to("neuron") for t in (x, w, go, mean, var, weight)]
    for call in range(4):
        assert torch.equal(step(*dev).cpu(), want), call


def test_ops_whose_scalar_arguments_change_at_every_call_launch_without_a_host_wait() -> None:
    # The optimizers' step sizes change at every step (AdamW: p.addcdiv_(m, d, value=-step_size), and the
    # foreach form with a list of step sizes): a plan is per structure, not per scalar value, so only the
    # first call of a structure is checked on the host.
    g = torch.Generator().manual_seed(7)
    cpu = [torch.randn(32, 32, generator=g) for _ in range(6)]
    p, m, d, q, n, e = (t.to("neuron") for t in cpu)
    d.abs_().add_(1)
    e.abs_().add_(1)
    cpu[2].abs_().add_(1)
    cpu[5].abs_().add_(1)
    p.addcdiv_(m, d, value=-0.5)
    torch._foreach_addcdiv_([p, q], [m, n], [d, e], [-0.5, -0.25])
    p.lerp_(m, 0.5)
    cpu[0].addcdiv_(cpu[1], cpu[2], value=-0.5)
    torch._foreach_addcdiv_([cpu[0], cpu[3]], [cpu[1], cpu[4]], [cpu[2], cpu[5]], [-0.5, -0.25])
    cpu[0].lerp_(cpu[1], 0.5)
    for step in range(1, 4):
        size = 0.1 / (1 - 0.9**step)

        def launch(size: float = size) -> None:
            p.addcdiv_(m, d, value=-size)
            torch._foreach_addcdiv_([p, q], [m, n], [d, e], [-size, -2 * size])
            p.lerp_(m, size)

        _, queued, syncs = _launched_behind_a_sleep(launch)
        assert syncs == ["sync: torch.neuron.synchronize()"], (step, syncs)
        assert queued == 4, step  # the sleep, addcdiv_, the foreach op (one launch), lerp_: none waited
        cpu[0].addcdiv_(cpu[1], cpu[2], value=-size)
        torch._foreach_addcdiv_([cpu[0], cpu[3]], [cpu[1], cpu[4]], [cpu[2], cpu[5]], [-size, -2 * size])
        cpu[0].lerp_(cpu[1], size)
        assert torch.equal(p.cpu(), cpu[0]) and torch.equal(q.cpu(), cpu[3]), step  # each call used its own value


def test_a_scalar_value_the_meta_kernel_rejects_raises_at_once_and_leaves_the_op_launchable() -> None:
    x = torch.arange(16, dtype=torch.int64).reshape(4, 4)
    xn = x.to("neuron")
    assert torch.equal(torch.pow(xn, 2).cpu(), torch.pow(x, 2))
    assert torch.equal(torch.pow(xn, 3).cpu(), torch.pow(x, 3))
    with pytest.raises(RuntimeError, match="Integers to negative integer powers are not allowed"):
        torch.pow(x, -1)
    with pytest.raises(RuntimeError, match="Integers to negative integer powers are not allowed"):
        torch.pow(xn, -1)  # at the call, as on CPU: not later, at a synchronisation point
    got, queued, syncs = _launched_behind_a_sleep(lambda: torch.pow(xn, 2))
    assert queued == 2 and syncs == ["sync: torch.neuron.synchronize()"]
    assert torch.equal(got.cpu(), torch.pow(x, 2))
    # a float16 fill beyond float16's range: CPU's overflow check, at the call
    h = torch.zeros(4, dtype=torch.float16, device="neuron")
    h.fill_(2.0)
    with pytest.raises(RuntimeError, match="without overflow"):
        torch.zeros(4, dtype=torch.float16).fill_(1e6)
    with pytest.raises(RuntimeError, match="without overflow"):
        h.fill_(1e6)
    assert h.cpu().tolist() == [2.0] * 4


def test_scalar_arguments_that_decide_the_shape_still_make_their_own_shapes() -> None:
    # arange's Scalar end decides its size (its out= kernel resizes: the host path): a plan keyed by the
    # Scalars' types must never hand one end's size to another
    for end in (5.0, 9.0, 5.0, 2.5, 12.0, 7.0):
        got = torch.arange(0.0, end, 1.0, device="neuron")
        want = torch.arange(0.0, end, 1.0)
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got.cpu(), want), end
    for end in (3.0, 6.0):  # and a launched op whose Scalar changes, between them
        x = torch.full((4,), end, device="neuron")
        assert x.cpu().tolist() == [end] * 4


def test_a_foreach_op_whose_scalars_change_at_every_call_does_not_rerun_its_python_meta_kernel() -> None:
    # Adam/AdamW (foreach, the default on neuron) pass new step sizes at every step as a Scalar list:
    # `_foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)`, `_foreach_div_(sqrts, bias_corrections)`,
    # each launched as one op, and per tensor (`addcdiv_`, whose Meta kernel is Python: ~35 us a call) where
    # a foreach op is not launched as one (and in optimizers with foreach=False).
    # Values of an in-place elementwise op's float Scalars decide neither sizes nor dtypes: its launched
    # plan holds without running the Meta kernel again.
    gen = torch.Generator().manual_seed(5)
    cpu = [[torch.randn(8, 8, generator=gen) for _ in range(3)] for _ in range(3)]
    cpu[2] = [d.abs() + 1 for d in cpu[2]]
    dev = [[t.to("neuron") for t in ts] for ts in cpu]

    def per_tensor(ps: list, ms: list, ds: list, sizes: list[float]) -> None:
        for p, m, d, v in zip(ps, ms, ds, sizes):
            p.addcdiv_(m, d, value=v)

    for step in range(1, 4):  # the first launch is checked on the host, the next ones are launched
        for ps, ms, ds in (cpu, dev):
            torch._foreach_addcdiv_(ps, ms, ds, [-0.01 * step, -0.02 * step, -0.03 * step])
            torch._foreach_div_(ms, [1.0 + 0.1 * step] * 3)
            per_tensor(ps, ms, ds, [0.01 * step, 0.02 * step, 0.03 * step])
    files: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "call":
            files.append(frame.f_code.co_filename)  # type: ignore[attr-defined]

    def launch() -> None:
        sys.setprofile(profile)
        try:
            torch._foreach_addcdiv_(dev[0], dev[1], dev[2], [-0.5, -0.25, -0.125])
            torch._foreach_div_(dev[1], [1.5, 1.25, 1.125])
            per_tensor(dev[0], dev[1], dev[2], [0.5, 0.25, 0.125])
        finally:
            sys.setprofile(None)

    _, queued, syncs = _launched_behind_a_sleep(launch)
    meta = sorted({f for f in files if "_meta_registrations" in f or "/_refs/" in f or "/_prims" in f})
    assert meta == [], meta
    # the sleep, the two foreach ops (one launch each), three addcdiv_
    assert queued == 6 and syncs == ["sync: torch.neuron.synchronize()"]
    torch._foreach_addcdiv_(cpu[0], cpu[1], cpu[2], [-0.5, -0.25, -0.125])
    torch._foreach_div_(cpu[1], [1.5, 1.25, 1.125])
    per_tensor(cpu[0], cpu[1], cpu[2], [0.5, 0.25, 0.125])
    for got, want in zip(dev[0] + dev[1], cpu[0] + cpu[1]):
        assert torch.equal(got.cpu(), want)


def test_ops_that_touch_no_device_bytes_do_not_wait_for_the_stream() -> None:
    # Every GPT-2 training step (transformers) waited for the whole queue twice per layer: `torch.arange(n,
    # device=...)` (an out= factory whose output is resized: the host path) and `torch.tensor([], device=...)`
    # (a zero-byte copy). An op whose device tensor arguments hold no bytes reads nothing a queued kernel
    # writes, so it runs on the host at once; its new memory comes only from blocks no queued kernel uses.
    want = torch.arange(64)
    got, queued, syncs = _launched_behind_a_sleep(lambda: torch.arange(64, device="neuron"))
    # the sleep still queued (not waited for); the arange run at once on the host or, once its plan was
    # checked, launched behind the sleep (an empty out= tensor sized at the launch)
    assert queued in (1, 2) and syncs == ["sync: torch.neuron.synchronize()"]
    assert torch.equal(got.cpu(), want)  # type: ignore[union-attr]
    got, queued, syncs = _launched_behind_a_sleep(lambda: torch.tensor([], device="neuron"))
    assert queued == 1 and syncs == ["sync: torch.neuron.synchronize()"]
    assert got.shape == (0,) and got.device.type == "neuron"  # type: ignore[union-attr]
    got, queued, syncs = _launched_behind_a_sleep(lambda: torch.empty(0, 3).to("neuron"))
    assert queued == 1 and syncs == ["sync: torch.neuron.synchronize()"]
    assert got.shape == (0, 3)  # type: ignore[union-attr]
    # a copy's checks still hold for empty tensors
    with pytest.raises(RuntimeError):
        torch.empty(0, 3, device="neuron").copy_(torch.empty(0, 4))
    with pytest.raises(RuntimeError):
        torch.empty(0, device="neuron").copy_(torch.ones(3))
    # a non-empty copy from pageable host memory still waits (as CUDA's blocking copy does)
    _, queued, syncs = _launched_behind_a_sleep(lambda: torch.ones(3).to("neuron"))
    assert queued == 0 and syncs[0] == "sync: host→device copy"


def test_host_code_that_waits_for_nothing_takes_no_block_a_queued_kernel_still_reads() -> None:
    # `a` is freed by the host while a queued kernel (behind a sleep) still reads it; an arange run on the
    # host at once must not be given a's block, or it would write over a's values before the kernel reads them
    torch.neuron.synchronize()
    a_cpu = torch.arange(4096, dtype=torch.float32)
    a = a_cpu.to("neuron")
    torch.neuron.synchronize()
    torch.neuron._sleep(200)
    b = a * 2
    del a
    c = torch.arange(4096, dtype=torch.float32, device="neuron") + 0.5
    torch.neuron.synchronize()
    assert torch.equal(b.cpu(), a_cpu * 2)
    assert torch.equal(c.cpu(), a_cpu + 0.5)


def test_an_out_op_into_an_empty_tensor_is_launched_and_sized_like_cpus() -> None:
    # ATen's functional ops run through their out= variant on an empty result (`torch.where` inside
    # `_safe_softmax`, which every attention with a mask calls): the out= tensor had to be resized, so the
    # call took the host path and waited for the whole queue (2-6 waits per transformers training step).
    gen = torch.Generator().manual_seed(3)
    cond = torch.rand(2, 2, 7, 1, generator=gen) > 0.5
    x = torch.randn(2, 2, 7, 7, generator=gen)
    zero = torch.zeros(())
    cn, xn, zn = cond.to("neuron"), x.to("neuron"), zero.to("neuron")
    want = torch.where(cond, zero, x, out=torch.empty(0))
    for _ in range(2):  # the first launch of the plan is checked on the host
        torch.where(cn, zn, xn, out=torch.empty(0, device="neuron"))
    out = torch.empty(0, device="neuron")
    view = out[:]  # shares out's (empty) storage: sized with it, as on CPU
    _, queued, syncs = _launched_behind_a_sleep(lambda: torch.where(cn, zn, xn, out=out))
    assert queued == 2 and syncs == ["sync: torch.neuron.synchronize()"]
    assert out.shape == want.shape and out.stride() == want.stride() and torch.equal(out.cpu(), want)
    assert view.untyped_storage().nbytes() == out.untyped_storage().nbytes() == want.untyped_storage().nbytes()
    # a non-empty out= of another shape keeps CPU's resize rules (the host path: warning, then resize)
    cpu_out = torch.zeros(3)
    with pytest.warns(UserWarning, match="resized"):
        torch.where(cond, zero, x, out=cpu_out)
    dev_out = torch.zeros(3, device="neuron")
    with pytest.warns(UserWarning, match="resized"):
        torch.where(cn, zn, xn, out=dev_out)
    assert torch.equal(dev_out.cpu(), cpu_out)
    # arange into an empty out= tensor, ends changing: each call gets its own size
    for end in (5, 9, 3):
        o = torch.empty(0, device="neuron")
        torch.arange(0, end, out=o)
        assert o.cpu().tolist() == list(range(end))


def test_an_out_variant_of_a_pointwise_op_writing_one_of_its_inputs_launches_without_a_host_wait() -> None:
    # ATen tags `where.self_out`, `relu.out`, `gelu.out`, `clone.out`, ... without `pointwise` (their
    # functional overloads have it). `_safe_softmax` -- every attention with a mask, in every transformers
    # model -- calls where(rows, zero, out, out=out): full overlap with an input, which the CPU kernel allows
    # for pointwise ops; untagged, it took the host path and waited for the whole queue (2-6 times a step).
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 7, 7, generator=gen)
    x[0, 0, 3] = float("-inf")
    xn = x.to("neuron")
    want = torch._safe_softmax(x, -1)
    r = torch.randn(64, generator=gen)
    rn = r.to("neuron")
    for _ in range(2):  # the first launch of each plan is checked on the host
        torch._safe_softmax(xn, -1)
        c = rn.clone()
        torch.ops.aten.relu.out(c, out=c)

    def launch() -> tuple[torch.Tensor, torch.Tensor]:
        y = torch._safe_softmax(xn, -1)
        return y, torch.ops.aten.relu.out(rn, out=rn)

    (got, relu_got), queued, syncs = _launched_behind_a_sleep(launch)  # type: ignore[misc]
    assert syncs == ["sync: torch.neuron.synchronize()"] and queued >= 6  # the sleep, softmax's 5, relu
    assert torch.equal(got.cpu(), want)
    assert relu_got is rn and torch.equal(rn.cpu(), torch.relu(r))


def test_new_shapes_of_a_structure_the_cpu_kernel_confirmed_launch_without_a_host_check() -> None:
    # Each plan key's first launch is checked against the CPU kernel on the host after a wait for the stream.
    # A mixture of experts routes a different number of tokens to each expert at every step: every new shape
    # paid that wait (~10 per Mixtral step). After 3 keys of a structure (sizes and strides abstracted) matched,
    # a new shape launches at once; a structure whose CPU kernel ever differed (channels-last convolution:
    # Meta plans contiguous outputs) is checked at every new shape. Fresh interpreter: exact counts.
    facts = run_child(
        """
        import torch, json
        import torchneuron_lab
        from torchneuron_lab.device._backend import lib
        C = lib()
        def delta(fn):
            c0 = C.launch_path_counts()
            torch.neuron.synchronize()
            torch.neuron._sleep(100)
            out = fn()
            queued = C.stream_counts(0, 0)
            c1 = C.launch_path_counts()
            torch.neuron.synchronize()
            return out, {k: c1[k] - c0[k] for k in c0}, queued[0] - queued[1]
        rows, same = [], True
        for n in (3, 5, 7, 9, 11, 13):
            x = torch.randn(n, 2, 6, dtype=torch.float64)
            xn = x.to("neuron")
            out, d, behind = delta(lambda: torch.special.erfcx(xn))
            want = torch.special.erfcx(x)
            same = same and torch.equal(out.cpu(), want) and out.stride() == want.stride()
            rows.append([d["plan_check"], d["trusted_new_shape"], behind])
        cl = torch.channels_last
        w = torch.randn(4, 3, 3, 3).contiguous(memory_format=cl)
        conv = []
        for b in (2, 3, 4, 5):
            x = torch.randn(b, 3, 8, 8).contiguous(memory_format=cl)
            xn, wn = x.to("neuron"), w.to("neuron")
            f = lambda: torch.ops.aten.convolution(xn, wn, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
            out, d, behind = delta(f)
            want = torch.ops.aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
            same = same and torch.equal(out.cpu(), want) and out.stride() == want.stride()
            conv.append([d["plan_check"], d["trusted_new_shape"]])
        print(json.dumps({"rows": rows, "conv": conv, "same": same}))
        """
    )
    assert facts["same"]  # bit-identical to CPU, with CPU's strides, either way
    # the first three shapes are checked on the host (the launch waited: only the sleep is behind it... then
    # nothing, as the check ran it); from the fourth, launched at once behind the sleep
    assert [r[:2] for r in facts["rows"]] == [[1, 0]] * 3 + [[0, 1]] * 3
    assert [r[2] for r in facts["rows"][3:]] == [2, 2, 2]  # the sleep and the kernel, both queued
    assert facts["conv"] == [[1, 0]] * 4
