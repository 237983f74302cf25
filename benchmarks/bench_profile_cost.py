"""Profiling cost (issue 9): %%neuron_profile vs torch.profiler on a transformer training step, per-event read cost.

Side by side in one process:

1. Reading the recorder: ``recorder.read()`` (packed columns, each distinct stack symbolized once,
   estimates on whole columns; events built on first use) per event, against the list path it replaced
   (``_C.recorder_read()`` + ``events_from_columns`` + ``annotate_estimates`` + per-event sources), with
   and without stacks; and the cost of then materialising ``trace.events``.
1b. ``summarize`` per event: on the trace's numpy columns vs via the KernelEvent list (the old path).
2. Recording cost per op on the neuron ``a + 1`` 64x64 path: off, on, on with stacks.
3. One training step (zero_grad, forward, loss, backward, AdamW step) of a small GPT-2 (transformers,
   from a config: 2 layers, d 128, 4 heads, vocab 1000, batch 4 x 64) and of an
   ``nn.TransformerEncoderLayer`` (d 128, 4 heads, ffn 512, batch 16 x 64): plain; under
   ``%%neuron_profile``'s own path (``profile_cell``: record with stacks + read + summary, display
   excluded); under ``torch.profiler.profile(activities=[CPU, PrivateUse1])`` + ``key_averages()`` (its
   summary). Rounds interleave the three, order alternating.

Bars: read <= 1 us/event (with stacks); %%neuron_profile step time <= torch.profiler's on each step.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import Report, Side, base_parser, calibrate, interleave, make_loop, setup

READ_BAR_US = 1.0
STEP_BAR = 1.0


def _timed_s(fn: Any) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_read(C: Any, n_events: int, with_stack: bool, rounds: int) -> dict[str, float]:
    from torchneuron_lab.device import profile, recorder
    from torchneuron_lab.device.profiles import annotate_estimates
    from torchneuron_lab.tracing import events_from_columns

    a = torch.randn(8, 8, device="neuron")

    def layer(x: torch.Tensor) -> torch.Tensor:  # a few distinct call paths, as a model has
        return x + 1

    recorder.clear()
    recorder.start(max(n_events, 1 << 16), with_stack=with_stack)
    for i in range(n_events // 2):
        layer(a)
        a * 2
    recorder.stop()
    n = len(recorder.read())

    def old_path() -> None:
        cols = C.recorder_read()
        stacks = cols["stack"]
        sources = []
        for st in stacks:  # the old per-event source lookup
            fr = recorder._user_frame(tuple(_frame(f) for f in st)) if st else None
            sources.append(None if fr is None else f"{fr.filename}:{fr.line} in {fr.name}")
        cols["source"] = sources
        annotate_estimates(events_from_columns(cols), profile())

    new_s, mat_s, old_s = [], [], []
    for r in range(rounds):
        holder: dict[str, Any] = {}
        new_s.append(_timed_s(lambda h=holder: h.setdefault("t", recorder.read())))
        mat_s.append(_timed_s(lambda h=holder: len(h["t"].events)))
        if r < max(1, rounds // 2):
            old_s.append(_timed_s(old_path))
    recorder.clear()
    return {
        "events": n,
        "read_us": statistics.median(new_s) / n * 1e6,
        "materialise_us": statistics.median(mat_s) / n * 1e6,
        "list_path_us": statistics.median(old_s) / n * 1e6,
    }


def bench_summarize(n_events: int, rounds: int) -> dict[str, float]:
    """``summarize`` of a recorded trace per event: on its numpy columns (``summarize(trace)``, what
    ``%%neuron_profile`` does now) vs building the KernelEvent list and summarising it
    (``summarize(trace.events)``, what it did before). Each side gets a fresh ``recorder.read()``."""
    from torchneuron_lab.device import recorder
    from torchneuron_lab.tracing import summarize

    a = torch.randn(8, 8, device="neuron")
    recorder.clear()
    recorder.start(max(n_events, 1 << 16), with_stack=True)
    for _ in range(n_events // 4):
        b = a + 1
        b = b * 2
        b = b.relu()
        b @ a
    recorder.stop()
    n = len(recorder.read())
    cols_s, list_s = [], []
    same = True
    for r in range(rounds):
        t_cols, t_list = recorder.read(), recorder.read()
        order = [("cols", t_cols), ("list", t_list)] if r % 2 == 0 else [("list", t_list), ("cols", t_cols)]
        got: dict[str, Any] = {}
        for name, t in order:
            def run(t: Any = t, name: str = name, got: dict[str, Any] = got) -> None:
                got[name] = summarize(t, k=None) if name == "cols" else summarize(t.events, k=None)

            (cols_s if name == "cols" else list_s).append(_timed_s(run))
        same = same and got["cols"] == got["list"]
    recorder.clear()
    return {"events": n, "columns_us": statistics.median(cols_s) / n * 1e6,
            "events_us": statistics.median(list_s) / n * 1e6, "same_result": same}


def _frame(f: dict[str, Any]) -> Any:
    from torchneuron_lab.tracing import StackFrame

    return StackFrame(f["filename"], int(f["line"]), f["name"])


def gpt2_step() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=1000)
    model = GPT2LMHeadModel(cfg).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1000, (4, 64)).to("neuron")

    def step() -> None:
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
        torch.neuron.synchronize()

    return step


def encoder_step() -> Any:
    layer = torch.nn.TransformerEncoderLayer(128, 4, 512, batch_first=True).to("neuron")
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-4)
    x = torch.randn(16, 64, 128).to("neuron")

    def step() -> None:
        opt.zero_grad()
        layer(x).pow(2).mean().backward()
        opt.step()
        torch.neuron.synchronize()

    return step


def bench_step(step: Any, rounds: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from torchneuron_lab.extension.helpers import profile_cell

    events: list[int] = []

    def ours() -> None:
        res, _, err = profile_cell(step, record_shapes=False, memory_peak=False, top=10)
        if err is not None:
            raise err
        events.append(len(res.trace))

    def torch_prof() -> None:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as p:
            step()
        p.key_averages()

    for fn in (step, step, ours, torch_prof):  # warm-up: signatures, allocator, profiler set-up
        fn()
    variants = {"plain": step, "neuron_profile": ours, "torch.profiler": torch_prof}
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for k in order:
            samples[k].append(_timed_s(variants[k]))
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"median_s": med, "samples_s": samples, "events": events[-1]}  # ratios: Report.compare in main()


def main() -> int:
    ap = base_parser(__doc__.splitlines()[0])
    args = ap.parse_args()
    setup(args)
    from torchneuron_lab.device._backend import lib

    C = lib()
    quick = args.quick
    rep = Report("bench_profile_cost", args)
    rep.header("profiling cost: %%neuron_profile vs torch.profiler; recorder read and record cost")
    C.recorder_stop()

    # ---- 1. read cost per event
    n_events = 4000 if quick else 100_000
    read_rounds = 2 if quick else 5
    reads = {ws: bench_read(C, n_events, ws, read_rounds) for ws in (True, False)}
    print(f"reading the recorder ({reads[True]['events']} events; us per event)")
    for ws, r in reads.items():
        print(f"  {'with stacks' if ws else 'no stacks  '}: read {r['read_us']:.3f} us, then building the "
              f"KernelEvent list {r['materialise_us']:.3f} us; list path (before) {r['list_path_us']:.2f} us "
              f"-> {r['list_path_us'] / r['read_us']:.1f}x faster")
    print()

    # ---- 1b. summary cost per event
    summ = bench_summarize(4000 if quick else 100_000, read_rounds)
    print(f"summarize ({summ['events']} recorded events; us per event): on the columns "
          f"{summ['columns_us']:.3f} us, via the KernelEvent list (before) {summ['events_us']:.3f} us -> "
          f"{summ['events_us'] / summ['columns_us']:.1f}x faster; same result: {summ['same_result']}")
    print()

    # ---- 2. recording cost per op
    target_s = 0.002 if quick else 0.03
    rounds = args.rounds or (3 if quick else 21)
    a = torch.randn(64, 64).to("neuron")
    cap = 1 << 20
    env = {"a": a, "_C": C, "_cap": cap}
    loops = {
        "off": make_loop("a + 1", env, setup="_C.recorder_stop()"),
        "on": make_loop("a + 1", env, setup="_C.recorder_clear()\n_C.recorder_start(_cap, False, False)",
                        teardown="_C.recorder_stop()\n_C.recorder_clear()"),
        "stack": make_loop("a + 1", env, setup="_C.recorder_clear()\n_C.recorder_start(_cap, False, True)",
                           teardown="_C.recorder_stop()\n_C.recorder_clear()"),
    }
    for k in ("on", "stack"):
        calibrate(loops[k], target_s, max_n=cap // 2)
    n = calibrate(loops["off"], target_s, max_n=cap // 2)
    sides = interleave(loops, n, rounds)
    rep.cost("recorder.add_64x64.record", "recording on vs off", sides["off"], sides["on"], n)
    rep.cost("recorder.add_64x64.with_stack", "recording on with stacks vs off", sides["off"], sides["stack"], n)

    # ---- 3. training steps
    step_rounds = args.rounds or (2 if quick else 9)
    steps = {"gpt2_train": gpt2_step(), "encoder_layer_train": encoder_step()}
    results = {k: bench_step(fn, step_rounds) for k, fn in steps.items()}
    print("training step (ms, median over interleaved rounds; profiling = record + read + summary, no display)")
    hdr = f"{'step':<22} {'events':>7} {'plain':>9} {'%%neuron_profile':>17} {'torch.profiler':>15}"
    print(hdr)
    print("-" * len(hdr))
    for k, r in results.items():
        m = r["median_s"]
        print(f"{k:<22} {r['events']:>7} {m['plain'] * 1e3:>9.1f} {m['neuron_profile'] * 1e3:>17.1f} "
              f"{m['torch.profiler'] * 1e3:>15.1f}")
    print()

    # ---- lines (all through the common Report: a ratio that is not computed is missing from its JSON too)
    for ws, r in reads.items():
        key = f"read.per_event.{'with_stack' if ws else 'no_stack'}"
        print(f"READ {key} = {r['read_us']:.3f} us/event (list path {r['list_path_us']:.2f} us/event)")
    rep.limit("read.per_event.with_stack", "recorder.read() per event, with stacks", reads[True]["read_us"],
              "us/event", READ_BAR_US)
    print(f"SUMMARIZE summarize.per_event columns/events_list = {summ['columns_us'] / summ['events_us']:.3f}x "
          f"({summ['columns_us']:.3f} vs {summ['events_us']:.3f} us/event, same result: {summ['same_result']})")
    if not summ["same_result"]:  # not a speed bar: the two paths must agree, or the number means nothing
        print("ERROR summarize on the columns differs from summarize on the events")
        return 1
    for k, r in results.items():
        side = {v: Side.of([s * 1e9 for s in r["samples_s"][v]]) for v in ("plain", "neuron_profile",
                                                                          "torch.profiler")}
        rep.compare(f"{k}.profile", f"{k}: %%neuron_profile vs plain", side["plain"], side["neuron_profile"], 1,
                    base_name="plain", cand_name="neuron_profile")
        rep.compare(f"{k}.torch_profiler", f"{k}: torch.profiler vs plain", side["plain"], side["torch.profiler"],
                    1, base_name="plain", cand_name="torch_profiler")
        rep.compare(f"{k}.profile_vs_torch_profiler", f"{k}: %%neuron_profile vs torch.profiler",
                    side["torch.profiler"], side["neuron_profile"], 1, bar=STEP_BAR,
                    base_name="torch_profiler", cand_name="neuron_profile")
    rep.print_limit_lines(rep.limits)
    rep.print_ratio_lines(rep.ratios)
    rep.print_cost_lines(rep.costs)
    rep.extra.update(read=reads, summarize=summ,
                     steps={k: {kk: vv for kk, vv in r.items()} for k, r in results.items()})
    return rep.finish()


if __name__ == "__main__":
    raise SystemExit(main())
