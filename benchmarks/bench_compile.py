"""Compiled over eager: ``torch.compile(backend="neuron")`` on neuron vs Inductor on CPU, side by side.

Bars (issue 3), for the same code on both sides:

- speedup: (eager neuron / ``backend="neuron"`` on neuron) >= 0.95x of (eager CPU / ``backend="inductor"``
  on CPU), for (a) an MLP training step (784-512-512-10, batch 64, cross-entropy, forward+backward
  compiled, ``SGD(momentum=0.9, foreach=False)`` eager) and (b) a transformer block forward
  (``nn.TransformerEncoderLayer`` d_model 256, 4 heads, batch 8 x seq 128, eval, ``no_grad``).
  In eval + ``no_grad`` that layer takes PyTorch's fused fast path (one ``_transformer_encoder_layer_fwd``
  op, on both devices), so there is little to compile; (c) is the same forward with the fast path
  disabled (``torch.backends.mha.set_fastpath_enabled(False)``), where the compilers have a graph
  of ~30 ops to fuse. (c) has the same bar.
- compile time: ours <= 1.2x Inductor-CPU's, per case. Compile time = first call minus a steady call,
  each measurement after ``torch._dynamo.reset()`` inside ``torch._inductor.utils.fresh_cache()`` (a
  fresh Inductor cache dir, in-memory code caches cleared): nothing is reused between the two sides,
  which compile the same C++ for the same graph. Median over repeats, the side that goes first
  alternating; one untimed compile per backend first pays the lazy imports.

Timing: the four loops of a case (eager/compiled x cpu/neuron) are interleaved in each round; the
speedup ratio is the median over rounds of (our speedup in that round / Inductor's in that round).
Outputs of the compiled and eager code are compared once (not timed) as a sanity check.

    python benchmarks/bench_compile.py [--quick] [--json out.json] [--threads N] [--rounds N] [--strict]
                                       [--cases gelu_ln_fwd_bwd,elementwise_chain]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _common import Report, base_parser, calibrate, interleave, make_loop, setup
from torch import nn

SPEEDUP_BAR = 0.95  # ours / Inductor-CPU's, at least
COMPILE_BAR = 1.2  # ours / Inductor-CPU's, at most

DEVICES = ("cpu", "neuron")
BACKEND = {"cpu": "inductor", "neuron": "neuron"}
SIDE_NAME = {"cpu": "inductor-cpu", "neuron": "neuron"}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(d_model=256, nhead=4, dropout=0.0, batch_first=True).eval()


def mlp_env(device: str, model: nn.Module, backend: str | None) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 784, generator=gen).to(device)
    y = torch.randint(0, 10, (64,), generator=gen).to(device)
    m = copy.deepcopy(model).to(device)

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x), y)

    fn = torch.compile(loss_fn, backend=backend, fullgraph=True) if backend else loss_fn
    opt = torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, foreach=False)
    return {"loss_fn": fn, "opt": opt, "x": x, "y": y, "model": m}


def encoder_env(device: str, model: nn.Module, backend: str | None) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 128, 256, generator=gen).to(device)
    m = copy.deepcopy(model).to(device)
    fn = torch.compile(m, backend=backend, fullgraph=True) if backend else m
    return {"block": fn, "x": x, "model": m}


def gelu_ln() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256)]
    return nn.Sequential(*layers)


def gelu_ln_env(device: str, model: nn.Module, backend: str | None) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen).to(device)
    m = copy.deepcopy(model).to(device)

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        return m(x).square().mean()  # a sum of LayerNorm outputs is ~0: a useless sanity check

    fn = torch.compile(loss_fn, backend=backend, fullgraph=True) if backend else loss_fn
    return {"loss_fn": fn, "x": x, "model": m}


def chain(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.exp(torch.tanh(torch.cos(torch.relu(torch.sin(x) * 1.5)))), max=2.0)


def chain_env(device: str, model: nn.Module, backend: str | None) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1024, 1024, generator=gen).to(device)
    fn = torch.compile(chain, backend=backend, fullgraph=True) if backend else chain
    return {"chain": fn, "x": x, "model": model}


FWD_BWD = """
loss = loss_fn(x)
loss.backward()
"""

CHAIN = """
out = chain(x)
"""

MLP_STEP = """
opt.zero_grad(set_to_none=True)
loss = loss_fn(x, y)
loss.backward()
opt.step()
"""

ENC_FWD = """
with torch.no_grad():
    out = block(x)
"""


@dataclass
class Case:
    key: str
    label: str
    model: Callable[[], nn.Module]
    env: Callable[[str, nn.Module, str | None], dict[str, Any]]
    stmt: str
    fastpath: bool = True

    def output(self, env: dict[str, Any]) -> torch.Tensor:
        """The value compared between eager and compiled (sanity check, untimed)."""
        if self.stmt is MLP_STEP:
            return env["loss_fn"](env["x"], env["y"]).detach()
        if self.stmt is FWD_BWD:
            return env["loss_fn"](env["x"]).detach()
        if self.stmt is CHAIN:
            return env["chain"](env["x"])
        with torch.no_grad():
            return env["block"](env["x"])


CASES = [
    Case(
        "compile.mlp_sgd_step", "(a) MLP 784-512-512-10 b64 train step, SGD(momentum)", mlp, mlp_env, MLP_STEP
    ),
    Case(
        "compile.encoder_fwd",
        "(b) TransformerEncoderLayer d256 h4 8x128 eval no_grad fwd",
        encoder,
        encoder_env,
        ENC_FWD,
    ),
    Case(
        "compile.encoder_fwd_nofastpath",
        "(c) same, MHA fast path disabled",
        encoder,
        encoder_env,
        ENC_FWD,
        fastpath=False,
    ),
    Case(
        "compile.gelu_ln_fwd_bwd",
        "(d) (Linear256,GELU,LayerNorm)x4 b64 fwd+bwd, no optimizer",
        gelu_ln,
        gelu_ln_env,
        FWD_BWD,
    ),
    Case("compile.elementwise_chain", "(e) sin,mul,relu,cos,tanh,exp,clamp on 1024^2", nn.Identity, chain_env, CHAIN),
]


class _fastpath:
    """``torch.backends.mha`` fast path on/off for a block (restored after)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> None:
        self.prev = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(self.enabled)

    def __exit__(self, *exc: object) -> None:
        torch.backends.mha.set_fastpath_enabled(self.prev)


def _neuron_calls() -> int:
    from torchneuron_lab.compiler import list_subgraphs

    return sum(r.calls for r in list_subgraphs())


def compile_seconds(case: Case, model: nn.Module, device: str) -> float:
    """First call minus a steady call of the compiled code, from a reset Dynamo and a fresh cache."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    with fresh_cache():
        env = case.env(device, model, BACKEND[device])
        loop = make_loop(case.stmt, env)
        first = loop(1)
        steady = min(loop(1) for _ in range(3))
    torch._dynamo.reset()
    return max(0.0, (first - steady) / 1e9)


def warm_imports() -> None:
    """One untimed compile per backend, so neither side pays Inductor's lazy imports in a measurement."""

    def f(a: torch.Tensor) -> torch.Tensor:
        return (a.sin() @ a).relu().sum()

    for device in DEVICES:
        a = torch.randn(4, 4, device=device, requires_grad=True)
        torch.compile(f, backend=BACKEND[device])(a).backward()
    torch._dynamo.reset()


def main() -> int:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--compile-reps", type=int, default=None, help="compile-time measurements per side")
    ap.add_argument("--cases", default="", help="comma-separated case keys to run, e.g. gelu_ln_fwd_bwd,"
                    "elementwise_chain (default: all)")
    args = ap.parse_args()
    setup(args)
    import torchneuron_lab.compiler  # noqa: F401  (registers backend="neuron")

    # Shapes never change here; keep Dynamo from guessing dynamic dims anyway.
    torch._dynamo.config.automatic_dynamic_shapes = False
    quick = args.quick
    rounds = args.rounds or (3 if quick else 21)
    target_s = 0.01 if quick else 0.15
    reps = args.compile_reps or (1 if quick else 3)

    rep = Report("bench_compile", args)
    rep.header("compiled over eager: backend='neuron' on neuron vs backend='inductor' on CPU (float32)")
    print(
        "   here: speedup = eager / compiled per round; RATIO .speedup = median over rounds of (our speedup /"
    )
    print(
        "   Inductor-CPU's speedup in the same round); RATIO .compile_time = our compile s / Inductor-CPU's"
    )
    print()

    t_start = time.perf_counter()
    warm_imports()
    results: dict[str, dict[str, Any]] = {}
    wanted = [c for c in args.cases.split(",") if c]
    for case in CASES:
        if wanted and not any(case.key.endswith(w) for w in wanted):
            continue
        torch.manual_seed(0)
        model = case.model()
        with _fastpath(case.fastpath):
            # ---- compile time, alternating which side goes first
            secs: dict[str, list[float]] = {d: [] for d in DEVICES}
            for r in range(reps):
                for device in DEVICES if r % 2 == 0 else DEVICES[::-1]:
                    secs[device].append(compile_seconds(case, model, device))
            compile_s = {d: statistics.median(v) for d, v in secs.items()}

            # ---- steady-state time of the four variants, interleaved
            torch._dynamo.reset()
            envs = {
                f"{d}.{mode}": case.env(d, model, BACKEND[d] if mode == "compiled" else None)
                for d in DEVICES
                for mode in ("eager", "compiled")
            }
            # sanity, untimed: one output of the compiled code vs eager, from the same weights (this call
            # also compiles the compiled variants)
            calls0 = _neuron_calls()
            outs = {k: case.output(env).float().cpu() for k, env in envs.items()}
            check = {
                d: float(
                    (outs[f"{d}.compiled"] - outs[f"{d}.eager"]).abs().max()
                    / outs[f"{d}.eager"].abs().max().clamp_min(1e-12)
                )
                for d in DEVICES
            }
            loops = {k: make_loop(case.stmt, env) for k, env in envs.items()}
            for k, loop in loops.items():
                if k != "cpu.eager":
                    calibrate(loop, target_s)  # warm-up
            n = calibrate(loops["cpu.eager"], target_s)
            if _neuron_calls() == calls0:
                raise RuntimeError(f"{case.key}: backend='neuron' never ran (Dynamo fell back to eager?)")
            sides = interleave(loops, n, rounds)

            torch._dynamo.reset()

        speed = {
            d: [e / c for e, c in zip(sides[f"{d}.eager"].samples, sides[f"{d}.compiled"].samples)]
            for d in DEVICES
        }
        speed_ratio = statistics.median(o / i for o, i in zip(speed["neuron"], speed["cpu"]))
        # min-of-N (each variant's fastest block): the least noisy view on a shared machine
        mins = {k: side.min_ns for k, side in sides.items()}
        speed_min = {d: mins[f"{d}.eager"] / mins[f"{d}.compiled"] for d in DEVICES}
        compile_ratio = compile_s["neuron"] / max(compile_s["cpu"], 1e-9)
        for k, side in sides.items():
            rep.single(f"{case.key}.{k}", f"{case.label} [{k}]", side, n)
        rep.ratios.append(
            {
                "key": f"{case.key}.speedup",
                "ratio": speed_ratio,
                "bar": SPEEDUP_BAR,
                "pass": speed_ratio >= SPEEDUP_BAR,
                "direction": ">=",
            }
        )
        rep.ratios.append(
            {
                "key": f"{case.key}.compile_time",
                "ratio": compile_ratio,
                "bar": COMPILE_BAR,
                "pass": compile_ratio <= COMPILE_BAR,
                "direction": "<=",
            }
        )
        results[case.key] = {
            "label": case.label,
            "iters_per_block": n,
            "rounds": rounds,
            "speedup": {SIDE_NAME[d]: statistics.median(v) for d, v in speed.items()},
            "speedup_ratio": speed_ratio,
            "speedup_min": {SIDE_NAME[d]: v for d, v in speed_min.items()},
            "speedup_ratio_min": speed_min["neuron"] / speed_min["cpu"],
            "abs_ratio_min": mins["neuron.compiled"] / mins["cpu.compiled"],
            "eager_ratio_min": mins["neuron.eager"] / mins["cpu.eager"],
            "compile_s": {SIDE_NAME[d]: v for d, v in compile_s.items()},
            "compile_s_samples": {SIDE_NAME[d]: v for d, v in secs.items()},
            "compile_ratio": compile_ratio,
            "compiled_vs_eager_max_rel_diff": {SIDE_NAME[d]: v for d, v in check.items()},
            "faults_per_iter": {k: side.median_faults for k, side in sides.items()},
        }

    _print(rep, results)
    rep.extra["cases"] = results
    rep.extra["wall_s"] = time.perf_counter() - t_start
    return rep.finish()


def _ms(row: dict[str, Any]) -> str:
    return f"{row['value']['median_ns'] / 1e6:9.3f} ms"


def _print(rep: Report, results: dict[str, dict[str, Any]]) -> None:
    rows = {r["key"]: r for r in rep.rows}
    head = (
        f"{'case':<62} {'eager cpu':>12} {'inductor':>12} {'eager neuron':>12} {'neuron':>12}"
        f"  {'iters x rounds':>14}"
    )
    print(head)
    print("-" * len(head))
    for key, res in results.items():
        cells = []
        for k in ("cpu.eager", "cpu.compiled", "neuron.eager", "neuron.compiled"):
            cells.append(_ms(rows[f"{key}.{k}"]))
        print(f"{res['label']:<62} {' '.join(cells)}  {res['iters_per_block']:>7} x {res['rounds']:<5}")
    print()
    print("median per-block times above; speedup = eager / compiled (median over rounds); compile time in s")
    print("minor page faults per iteration (median over blocks; glibc returning freed temporaries to the kernel):")
    for key, res in results.items():
        f = res["faults_per_iter"]
        print(f"  {key:<34} eager cpu {f['cpu.eager']:7.0f}  inductor {f['cpu.compiled']:7.0f}  "
              f"eager neuron {f['neuron.eager']:7.0f}  neuron {f['neuron.compiled']:7.0f}")
    print("sanity (untimed): max |compiled - eager| / max |eager| of one output per side")
    for key, res in results.items():
        chk = res["compiled_vs_eager_max_rel_diff"]
        print(f"  {key:<34} rel diff neuron {chk['neuron']:.1e}, inductor-cpu {chk['inductor-cpu']:.1e}")
    print()
    for key, res in results.items():
        sp, cs = res["speedup"], res["compile_s"]
        print(f"SPEEDUP {key} neuron = {sp['neuron']:.3f}x, inductor-cpu = {sp['inductor-cpu']:.3f}x")
        print(f"COMPILE {key} neuron = {cs['neuron']:.2f} s, inductor-cpu = {cs['inductor-cpu']:.2f} s")
    for key, res in results.items():
        sp = res["speedup_min"]
        print(f"MIN {key} speedup neuron = {sp['neuron']:.3f}x, inductor-cpu = {sp['inductor-cpu']:.3f}x, "
              f"ratio = {res['speedup_ratio_min']:.3f}x; compiled neuron / inductor-cpu time = "
              f"{res['abs_ratio_min']:.3f}x; eager neuron / eager cpu time = {res['eager_ratio_min']:.3f}x")
    for r in rep.ratios:
        what = "speedup" if r["key"].endswith(".speedup") else "compile time"
        print(
            f"RATIO {r['key']} neuron/inductor-cpu = {r['ratio']:.3f}x  "
            f"[{what} bar {r['direction']} {r['bar']:.2f}x: {'PASS' if r['pass'] else 'FAIL'}]"
        )


if __name__ == "__main__":
    sys.exit(main())
