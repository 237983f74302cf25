"""OptimizerInfo conformance sweep: every ``optim_db`` optimizer with every configuration of its
``optim_inputs_func``, in each implementation it supports (default, ``foreach=True``, ``fused=True``),
on device parameters against the same on CPU. The driver (child processes, crash/timeout accounting,
report) is module_sweep.py's.

Per entry (id = ``<Optimizer>[<config desc>]<impl>``): three parameters (a matrix, a vector, a scalar)
from a fixed seed, three ``step(closure)`` calls where the closure computes
``sum((p - target)**2 * scale)`` and its backward (a closure works for every optimizer, LBFGS
included); the losses returned by ``step`` and the parameters and optimizer state after each step
are compared with CPU's (rtol 1e-5, atol 1e-6). CPU raising (e.g. a configuration CPU does not
support, such as ``capturable``) makes the entry a skip. SparseAdam, which takes sparse gradients only, gets
the same gradients as sparse COO tensors (on the device too).

    python -m tests.conformance.optim_sweep --device neuron --report /tmp/optim_neuron
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from tests.conformance import module_sweep as ms

IMPLS = ("default", "foreach", "fused")


def entries() -> dict[str, tuple[Any, Any, str]]:
    from torch.testing._internal.common_optimizers import optim_db

    out: dict[str, tuple[Any, Any, str]] = {}
    for info in optim_db:
        try:
            inputs = info.optim_inputs_func(device="cpu", dtype=torch.float32)
        except TypeError:
            inputs = info.optim_inputs_func(device="cpu")
        supported = set(getattr(info, "supported_impls", ()) or ())
        for k, oi in enumerate(inputs):
            for impl in IMPLS:
                if impl != "default" and impl not in supported:
                    continue
                if impl != "default" and impl in oi.kwargs:
                    continue
                desc = (oi.desc or f"config{k}").replace(" ", "_")
                key = f"{info.optim_cls.__name__}[{desc}]{'' if impl == 'default' else '.' + impl}"
                while key in out:
                    key += "+"
                out[key] = (info, oi, impl)
    return out


def _kwargs_on(kwargs: dict, device: str) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) and k not in ("lr",) else v) for k, v in kwargs.items()}


def _run(info: Any, oi: Any, impl: str, device: str) -> list:
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (3, 5)] if info.optim_cls.__name__ == "Muon" else [(4, 3), (3,), ()]  # Muon: 2-D only
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    targets = [torch.randn(s, generator=gen).to(device) for s in shapes]
    scales = [torch.rand(s, generator=gen).add(0.5).to(device) for s in shapes]
    kwargs = dict(_kwargs_on(oi.kwargs, device))
    if impl != "default":
        kwargs[impl] = True
    opt = info.optim_cls(params, **kwargs)
    trace: list = []

    sparse_grads = info.optim_cls.__name__ == "SparseAdam"  # it takes sparse gradients only (an embedding's)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = sum(((p - t) ** 2 * s).sum() for p, t, s in zip(params, targets, scales))
        loss.backward()
        if sparse_grads:
            for p in params:
                p.grad = p.grad.to_sparse()
        return loss

    for _ in range(3):
        loss = opt.step(closure)
        state = [v.detach().clone() for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
        trace.append(([loss] if isinstance(loss, torch.Tensor) else [], [p.detach().clone() for p in params], state))
    return trace


def run_optim_entry(entry: str, device: str) -> dict:
    info, oi, impl = entries()[entry]
    device_type = device.split(":")[0]
    try:
        expected = _run(info, oi, impl, "cpu")
    except Exception as exc:  # noqa: BLE001 - a sweep records every exception
        return {"status": "skip", "passed": 0, "total": 0, "message": "CPU raised: " + ms.short(exc, 300)}
    try:
        actual = _run(info, oi, impl, device)
    except Exception as exc:  # noqa: BLE001 - a sweep records every exception
        return {"status": "error", "passed": 0, "total": 1, "message": ms.short(exc)}
    for step, (e, a) in enumerate(zip(expected, actual)):
        if len(e[2]) != len(a[2]):
            return {"status": "fail", "passed": 0, "total": 1,
                    "message": f"step {step}: {len(a[2])} state tensors, expected {len(e[2])}"}
        # scalar state (step, NAdam's mu_product, LBFGS's tensor lr) stays a CPU scalar unless
        # capturable/fused, as on CUDA: compared by value; the rest must live on the parameters' device
        kept = [k for k, t in enumerate(a[2]) if t.dim() == 0 and t.device.type == "cpu"]
        scal_e, scal_a = [float(e[2][k]) for k in kept], [float(a[2][k]) for k in kept]
        e = (e[0], e[1], [t for k, t in enumerate(e[2]) if k not in kept], scal_e)
        a = (a[0], a[1], [t for k, t in enumerate(a[2]) if k not in kept], scal_a)
        for part, name in ((0, "loss"), (1, "params"), (2, "state")):
            ms_rtol, ms_atol = ms.RTOL, ms.ATOL
            ms.RTOL, ms.ATOL = 1e-5, 1e-6
            try:
                msg = ms.compare(e[part], a[part], device_type, f"step {step} {name}")
            finally:
                ms.RTOL, ms.ATOL = ms_rtol, ms_atol
            if msg:
                return {"status": "fail", "passed": 0, "total": 1, "message": msg}
        if e[3] != a[3]:
            return {"status": "fail", "passed": 0, "total": 1, "message": f"step {step}: scalar state {a[3]}, "
                                                                           f"expected {e[3]}"}
    return {"status": "pass", "passed": 1, "total": 1, "message": ""}


def main(argv: Sequence[str] | None = None) -> int:
    return ms.main_for("tests.conformance.optim_sweep", "optimizers", lambda: list(entries()), run_optim_entry, argv)


if __name__ == "__main__":
    sys.exit(main())
