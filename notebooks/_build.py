"""Generate the tutorial notebooks from the cell sources below (run: ``python notebooks/_build.py``).

The notebooks are committed without outputs; ``tests/test_notebooks.py`` executes each one through a real
Jupyter kernel and checks its key outputs. ``01_quickstart.ipynb`` is also copied into the package
(``torchneuron_lab/notebooks/``) so that ``torchneuron-lab demo`` works from an installed wheel.
Edit this file, not the ``.ipynb`` files, and re-run it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
PACKAGE_COPY = HERE.parent / "torchneuron_lab" / "notebooks"

# Each figure is displayed once: the magics' widgets carry a static copy of themselves (text/html, plotly.js
# inlined once per notebook, no CDN) after ``static_fallback()``. A live front-end shows the widget only; the
# exported HTML report, which has no widget state, shows the static copy only.
STATIC_FALLBACK = """\
from torchneuron_lab.widgets import static_fallback

static_fallback()  # widgets also carry a static copy, shown only where they cannot render (the HTML report)"""


def md(text: str) -> nbformat.NotebookNode:
    return new_markdown_cell(text.strip("\n"))


def code(text: str) -> nbformat.NotebookNode:
    return new_code_cell(text.strip("\n"))


# --------------------------------------------------------------------------- 01 quickstart
QUICKSTART = [
    md("""
# Quickstart: a model on the `neuron` device

`torchneuron_lab` registers an emulated NeuronCore device with PyTorch (`torch.device("neuron")`): kernels run
on the host CPU on device memory, with an allocator, a kernel recorder and Trainium roofline **estimates**.
This notebook loads the Jupyter extension, moves a small model to `neuron`, checks where every tensor lives,
and profiles one training step.
"""),
    code("""
%load_ext torchneuron_lab
"""),
    code(STATIC_FALLBACK),
    code("""
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512), torch.nn.Linear(512, 10)
).to("neuron")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
x = torch.randn(64, 256).to("neuron")
y = torch.randint(0, 10, (64,)).to("neuron")
print(next(model.parameters()).device, x.device)
"""),
    md("""
## Placement

`%neuron_placement` lists tensors, modules and optimizers in the namespace with per-device totals (each
storage counted once), and flags models split across devices or optimizer state on the wrong device.
"""),
    code("""
%neuron_placement
"""),
    code("""
placement = %neuron_placement -q -o
print(f"placement total neuron:0 = {placement.total('neuron:0')} bytes")
"""),
    md("""
## A profiled training step

`%%neuron_profile` runs the cell with the kernel recorder on: time by engine, top kernels, host syncs (the
`.item()` below) with their cell lines, new op signatures, and memory.
"""),
    code("""
%%neuron_profile --memory -k 8
for step in range(3):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step}: loss {loss.item():.4f}")
"""),
    code("""
prof = _neuron_profile
print(f"profile: {prof.count('kernel')} kernels, {prof.count('sync')} host syncs, "
      f"{len(prof.summary['new_signatures'])} new signatures")
"""),
    md("""
## Timeline and memory

In a Jupyter kernel the profiled cell above shows the interactive timeline (one lane per device x engine,
plus the host; hover or click a kernel for its details, drag to zoom, double-click to zoom out) and, with
`--memory`, the allocator's memory over the cell with its block map. `%neuron_memory` gives the allocator's
state now.
"""),
    code("""
%neuron_memory
"""),
    md("""
## Export for Perfetto

The profile's events as Chrome Trace Event JSON: open it at <https://ui.perfetto.dev> or `chrome://tracing`.
"""),
    code("""
path = prof.export("quickstart_trace.json")
print(f"wrote Perfetto trace {path}")
"""),
]

# --------------------------------------------------------------------------- 02 graph breaks
GRAPH_BREAKS = [
    md("""
# Graph breaks: find them, fix them

`torch.compile(backend="neuron")` captures graphs with Dynamo and compiles them with Inductor. Python
control flow that depends on tensor *values* and `.item()` calls split the graph ("graph breaks"), and
changing shapes recompile it. `%neuron_graph_breaks` shows where and why.
"""),
    code("""
%load_ext torchneuron_lab
import torch

torch.manual_seed(0)
"""),
    code("""
class GatedMLP(torch.nn.Module):
    \"\"\"A block with data-dependent control flow and a host sync: two graph breaks.\"\"\"

    def __init__(self, d=64):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        scale = h.abs().mean().item()          # .item(): a host sync -> graph break
        if h.sum() > 0:                         # data-dependent branch -> graph break
            h = h * 2.0
        return self.fc2(h) / scale


model = GatedMLP().to("neuron")
x = torch.randn(32, 64).to("neuron")
"""),
    code("""
before = %neuron_graph_breaks -o out = model(x)
"""),
    code("""
print(f"before the fix: {before.graph_count} graphs, {before.break_count} graph breaks")
for b in before.breaks:
    print(f" - {b['location']}: {b['reason']} (counted {b['count']}x)")
"""),
    md("""
Two places break the graph. The `.item()` break is counted twice: the magic compiles the statement
`out = model(x)`, so Dynamo meets the `.item()` once while inlining `forward` into the statement and again in
`forward`'s own frame (compiling `model` directly counts it once).
"""),
    md("""
## The fix

Keep the scale as a tensor (no `.item()`) and turn the branch into `torch.where`: one graph, no breaks, and
the same result.
"""),
    code("""
class GatedMLPFixed(GatedMLP):
    def forward(self, x):
        h = torch.relu(self.fc1(x))
        scale = h.abs().mean()                  # stays on the device
        h = torch.where(h.sum() > 0, h * 2.0, h)
        return self.fc2(h) / scale


fixed = GatedMLPFixed().to("neuron")
fixed.load_state_dict(model.state_dict())
"""),
    code("""
after = %neuron_graph_breaks -o out_fixed = fixed(x)
"""),
    code("""
print(f"after the fix: {after.graph_count} graphs, {after.break_count} graph breaks")
print("same result:", torch.allclose(out.cpu(), out_fixed.cpu(), rtol=1e-5, atol=1e-6))
"""),
    md("""
## Recompiles

A new input shape recompiles the graph (Dynamo marks the dimension dynamic after the second shape). The
subgraph registry lists every compiled graph with its guards and compile-time split.
"""),
    code("""
compiled = torch.compile(fixed, backend="neuron")
for batch in (8, 16, 24):
    compiled(torch.randn(batch, 64).to("neuron"))
"""),
    code("""
%neuron_subgraphs
"""),
    code("""
graphs = %neuron_subgraphs -q -o
print(f"subgraph records: {len(graphs.records)}")
"""),
]

# --------------------------------------------------------------------------- 03 memory
MEMORY = [
    md("""
# Memory: out-of-memory on a small device, and three fixes

The capacity is set to 64 MiB **before** the first neuron tensor exists (it cannot change afterwards; the
environment variable `TORCHNEURON_LAB_HBM_BYTES=64MiB` does the same). Then a batch grows until the
allocator runs out, `%neuron_memory` explains the failure, and smaller batches, activation checkpointing and
`empty_cache` fix it.
"""),
    code("""
import torchneuron_lab.device

print(torchneuron_lab.device.configure(hbm_bytes=64 * 2**20))
"""),
    code("""
%load_ext torchneuron_lab
import torch
import torch.utils.checkpoint

torch.manual_seed(0)


class Deep(torch.nn.Module):
    def __init__(self, d=256, depth=8, checkpoint=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
            for _ in range(depth))
        self.checkpoint = checkpoint

    def forward(self, x):
        for blk in self.blocks:
            if self.checkpoint:
                x = x + torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = x + blk(x)
        return x


model = Deep().to("neuron")
print(f"parameters: {sum(p.numel() for p in model.parameters()) * 4 / 2**20:.1f} MiB")
"""),
    code("""
def train_step(batch):
    x = torch.randn(batch, 256, device="neuron")
    loss = model(x).pow(2).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


batch, oom_batch, oom_message = 256, None, None
while batch <= 65536:
    try:
        train_step(batch)
        print(f"batch {batch:6d}: ok, peak {torch.neuron.max_memory_allocated() / 2**20:.1f} MiB")
        batch *= 2
    except torch.OutOfMemoryError as e:
        oom_batch, oom_message = batch, str(e)
        try:  # the device is asynchronous: kernels queued before the failure report theirs at a sync
            torch.neuron.synchronize()
        except torch.OutOfMemoryError:
            pass
        break
print(f"OOM at batch {oom_batch}")
print(oom_message.splitlines()[0])
"""),
    md("""
`%neuron_memory` right after the failure shows the allocator state at that moment and why it failed.
"""),
    code("""
%neuron_memory
"""),
    code("""
mem = %neuron_memory -q -o
print(f"allocated after the OOM: {mem.allocated / 2**20:.1f} MiB, reserved {mem.reserved / 2**20:.1f} MiB")
"""),
    md("""
## Fixes

1. `empty_cache()` returns the cached segments left behind by the failed step.
2. A smaller batch fits.
3. Activation checkpointing recomputes each block's activations in the backward pass, so the failing batch
   fits too.
"""),
    code("""
torch.neuron.empty_cache()
print(f"after empty_cache: reserved {torch.neuron.memory_reserved() / 2**20:.1f} MiB")


def peak_of(batch):
    # launch blocking: the peak of the model itself (asynchronously, kernels queued while the host runs
    # ahead also hold their outputs and workspaces, so the peak is higher)
    with torchneuron_lab.device.launch_blocking():
        torch.neuron.reset_peak_memory_stats()
        train_step(batch)
        return torch.neuron.max_memory_allocated()


small = oom_batch // 2
peak_small = peak_of(small)
model.checkpoint = True
peak_ckpt = peak_of(oom_batch)
model.checkpoint = False
print(f"peak at batch {small} (no checkpointing): {peak_small / 2**20:.1f} MiB")
print(f"peak at batch {oom_batch} with checkpointing: {peak_ckpt / 2**20:.1f} MiB")
print(f"checkpointing fits the OOM batch: {peak_ckpt < torchneuron_lab.device.current_config()['hbm_bytes']}")
"""),
]

# --------------------------------------------------------------------------- 04 timeline
TIMELINE = [
    md("""
# Eager vs compiled: kernel timelines

The same training step run eagerly and through `torch.compile(backend="neuron")`, each profiled with
`%%neuron_profile`. Eager mode launches one kernel per ATen op; the compiled step runs fused Inductor
kernels. Host syncs (`.item()`) and first-time op signatures are marked; both traces are exported as
Perfetto JSON. Each profiled cell shows its interactive timeline; "colour by: subgraph" tells the compiled
graphs' kernels apart.
"""),
    code("""
%load_ext torchneuron_lab
import torch
"""),
    code(STATIC_FALLBACK),
    code("""

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.LayerNorm(256), torch.nn.Linear(256, 10)
).to("neuron")
x = torch.randn(64, 128).to("neuron")
y = torch.randint(0, 10, (64,)).to("neuron")


def step(m):
    loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    return loss


compiled_model = torch.compile(model, backend="neuron")
step(compiled_model)  # compile outside the profiled cells
"""),
    code("""
%%neuron_profile -k 6
for _ in range(2):
    loss = step(model)
    loss.item()
"""),
    code("""
eager = _neuron_profile
"""),
    code("""
%%neuron_profile --compile -k 6
for _ in range(2):
    loss = step(compiled_model)
    loss.item()
"""),
    code("""
compiled = _neuron_profile
for name, p in (("eager", eager), ("compiled", compiled)):
    fused = sum(1 for e in p.events if e.kind == "kernel" and e.subgraph >= 0)
    print(f"{name}: {p.count('kernel')} kernels ({fused} from compiled graphs), {p.count('sync')} host syncs, "
          f"{len(p.summary['new_signatures'])} new signatures")
"""),
    md("""
## Perfetto export
"""),
    code("""
import json

from torchneuron_lab.tracing import validate_chrome_trace

for name, p in (("eager", eager), ("compiled", compiled)):
    path = p.export(f"{name}_trace.json")
    with open(path) as f:
        validate_chrome_trace(json.load(f))
    print(f"wrote valid Perfetto trace {path}")
"""),
]

# --------------------------------------------------------------------------- 05 transformer
TRANSFORMER = [
    md("""
# A Hugging Face transformer on `neuron`

A tiny GPT-2 built from a config with random weights (nothing is downloaded), trained three steps on the CPU,
eagerly on `neuron`, and compiled with `torch.compile(backend="neuron")`. The emulated device runs ATen's CPU
kernels on device memory, in the CPU's order, so the eager run is checked bit for bit against the CPU (every
loss and every trained parameter); the compiled run goes through Inductor's fused kernels, which reorder
floating-point sums, so its losses are compared by their relative difference.
"""),
    code("""
%load_ext torchneuron_lab
import copy

import torch
import transformers

transformers.logging.set_verbosity_error()
config = transformers.GPT2Config(
    vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
)
torch.manual_seed(0)
base = transformers.GPT2LMHeadModel(config)
g = torch.Generator().manual_seed(4)
batches = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(3)]
print(f"GPT-2: {sum(p.numel() for p in base.parameters())} parameters")
"""),
    code("""
def train(device, compile=False):
    model = copy.deepcopy(base).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    fwd = torch.compile(model, backend="neuron") if compile else model
    losses = []
    for ids in batches:
        ids = ids.to(device)
        opt.zero_grad(set_to_none=True)
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


cpu_losses, cpu_model = train("cpu")
eager_losses, eager_model = train("neuron")
compiled_losses, _ = train("neuron", compile=True)
print("cpu     ", " ".join(f"{v:.6f}" for v in cpu_losses))
print("eager   ", " ".join(f"{v:.6f}" for v in eager_losses))
print("compiled", " ".join(f"{v:.6f}" for v in compiled_losses))
"""),
    code("""
def max_rel(a, b):
    return max(abs(u - v) / max(abs(u), 1e-12) for u, v in zip(a, b))


params = list(zip(cpu_model.parameters(), eager_model.parameters()))
same_losses = sum(c == e for c, e in zip(cpu_losses, eager_losses))  # exact float equality
same_params = sum(torch.equal(c, e.cpu()) for c, e in params)
print(f"eager vs cpu: {same_losses}/{len(cpu_losses)} losses and {same_params}/{len(params)} trained parameters "
      f"bit-for-bit equal (max relative loss difference {max_rel(cpu_losses, eager_losses):.2e})")
print(f"compiled vs cpu: max relative loss difference {max_rel(cpu_losses, compiled_losses):.2e}")
"""),
    code("""
%neuron_placement eager_model
"""),
    code("""
%neuron_subgraphs
"""),
]

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_graph_breaks.ipynb": GRAPH_BREAKS,
    "03_memory_and_oom.ipynb": MEMORY,
    "04_kernel_timeline.ipynb": TIMELINE,
    "05_transformer.ipynb": TRANSFORMER,
}


def build(name: str) -> nbformat.NotebookNode:
    nb = new_notebook(cells=NOTEBOOKS[name])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable ids keep diffs small
        cell["id"] = f"{Path(name).stem[:2]}-{i:02d}"
    nbformat.validate(nb)
    return nb


def main() -> int:
    for name in NOTEBOOKS:
        nbformat.write(build(name), HERE / name)
        print(f"wrote {HERE / name}")
    PACKAGE_COPY.mkdir(exist_ok=True)
    (PACKAGE_COPY / "__init__.py").write_text('"""Notebooks shipped with the package (generated by notebooks/_build.py)."""\n')
    shutil.copyfile(HERE / "01_quickstart.ipynb", PACKAGE_COPY / "01_quickstart.ipynb")
    print(f"copied 01_quickstart.ipynb to {PACKAGE_COPY}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
