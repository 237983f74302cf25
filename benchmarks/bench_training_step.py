"""Training-step time on the emulated neuron device vs CPU, measured side by side.

Bar (issue 2): an MLP training step (784-512-512-10, batch 64, cross-entropy; zero_grad, forward,
backward, optimizer step) on neuron <= 1.2x the same step on CPU; measured with SGD(momentum=0.9)
and with AdamW, both ``foreach=False``. Also reported (no bar): one step of a small
``nn.TransformerEncoderLayer`` (d_model 128, 4 heads, ffn 512, batch 16 x seq 64, AdamW).

Both sides start from the same weights (the CPU model is deep-copied to neuron).

    python benchmarks/bench_training_step.py [--quick] [--json out.json] [--threads N] [--strict]
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import Report, base_parser, calibrate, interleave, make_loop, setup
from torch import nn

MLP_BAR = 1.2


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(
        d_model=128, nhead=4, dim_feedforward=512, dropout=0.0, batch_first=True, norm_first=True
    )


OptFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=False)


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def mlp_step_env(device: str, model: nn.Module, opt_f: OptFactory) -> dict[str, object]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 784, generator=gen).to(device)
    y = torch.randint(0, 10, (64,), generator=gen).to(device)
    m = copy.deepcopy(model).to(device)
    return {"model": m, "opt": opt_f(list(m.parameters())), "x": x, "y": y, "F": F}


def enc_step_env(device: str, model: nn.Module, opt_f: OptFactory) -> dict[str, object]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 64, 128, generator=gen).to(device)
    y = torch.randn(16, 64, 128, generator=gen).to(device)
    m = copy.deepcopy(model).to(device)
    return {"model": m, "opt": opt_f(list(m.parameters())), "x": x, "y": y, "F": F}


MLP_STEP = """
opt.zero_grad(set_to_none=True)
loss = F.cross_entropy(model(x), y)
loss.backward()
opt.step()
"""

ENC_STEP = """
opt.zero_grad(set_to_none=True)
loss = F.mse_loss(model(x), y)
loss.backward()
opt.step()
"""

# key, label, model factory, env builder, step, optimizer, bar
CASES = [
    (
        "train.mlp_sgd",
        "MLP 784-512-512-10 b64, SGD(momentum) foreach=False",
        mlp,
        mlp_step_env,
        MLP_STEP,
        sgd,
        MLP_BAR,
    ),
    (
        "train.mlp_adamw",
        "MLP 784-512-512-10 b64, AdamW foreach=False",
        mlp,
        mlp_step_env,
        MLP_STEP,
        adamw,
        MLP_BAR,
    ),
    (
        "train.encoder_layer_adamw",
        "TransformerEncoderLayer d128 h4 ffn512 16x64, AdamW",
        encoder,
        enc_step_env,
        ENC_STEP,
        adamw,
        None,
    ),
]


def main() -> int:
    ap = base_parser(__doc__.splitlines()[0])
    args = ap.parse_args()
    setup(args)
    quick = args.quick
    rounds = args.rounds or (3 if quick else 21)
    target_s = 0.01 if quick else 0.15

    rep = Report("bench_training_step", args)
    rep.header("training step: neuron vs CPU (float32)")

    losses: dict[str, dict[str, float]] = {}
    for key, label, model_f, env_f, step, opt_f, bar in CASES:
        torch.manual_seed(0)
        model = model_f()
        envs = {dev: env_f(dev, model, opt_f) for dev in ("cpu", "neuron")}
        loops = {dev: make_loop(step, env) for dev, env in envs.items()}
        calibrate(loops["neuron"], target_s)
        n = calibrate(loops["cpu"], target_s)
        sides = interleave(loops, n, rounds)
        rep.compare(key, label, sides["cpu"], sides["neuron"], n, bar=bar)
        # Sanity, not a timing: 3 steps from the same weights on fresh copies, then the loss on each side.
        check = {dev: env_f(dev, model, opt_f) for dev in ("cpu", "neuron")}
        for env in check.values():
            make_loop(step, env)(3)
        loss_fn = F.cross_entropy if step is MLP_STEP else F.mse_loss
        with torch.no_grad():
            loss_of = {
                dev: float(loss_fn(env["model"](env["x"]), env["y"]).cpu()) for dev, env in check.items()
            }
        losses[key] = loss_of

    rep.print_compare_table(rep.rows, unit="ms")
    print("loss after 3 untimed steps from the same weights (a sanity check, not a bar):")
    for key, lo in losses.items():
        rel = abs(lo["neuron"] - lo["cpu"]) / max(abs(lo["cpu"]), 1e-12)
        print(f"  {key:<28} cpu {lo['cpu']:.6f}  neuron {lo['neuron']:.6f}  rel diff {rel:.2e}")
    rep.extra["loss_after_3_steps"] = losses
    print()
    rep.print_ratio_lines(rep.ratios)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
