"""ModuleInfo conformance sweep: every ``module_db`` entry's samples on CPU and on a target device.

Like ``opinfo_sweep.py`` (read its docstring), with a small generic driver shared by
``optim_sweep.py``:

* **driver**: splits the entry ids into chunks and runs each chunk in a child process, two at a time;
  the child appends ``start``/``result`` JSON lines to a progress file, so an entry that kills its
  child (segfault, abort) is recorded as ``crash`` and the chunk goes on in a new child from the next
  entry; an entry silent for ``--timeout`` seconds is killed and recorded as ``error`` (timeout).
  Writes ``<report>.json`` and ``<report>.md`` and prints the summary line::

      python -m tests.conformance.module_sweep --device neuron --report /tmp/modules_neuron

* **child** (``--ids-file``): runs the listed entries in-process.

Per ModuleInfo entry (id = ``formatted_name``): the float32 samples of ``module_inputs_func`` (training
mode, and eval mode too where ``train_and_eval_differ``). Per sample: the module is built on CPU with a
fixed seed, a deep copy moved to the device; the forward runs on both with the same seed (dropout-like
modules draw the same numbers: the device's generator is seeded like the CPU's), then a backward of
``sum(out * w)`` (fixed ``w``) gives input and parameter gradients. Outputs, input gradients and
parameter gradients are compared with ``torch.testing.assert_close`` (rtol 1e-5, atol 1e-5: float32
rounding of reductions whose order differs, e.g. recurrent layers on non-CPU devices).

Statuses as in the OpInfo sweep: pass, fail (a mismatch), error (the device raised where CPU did not,
or timeout), crash, skip (CPU raised on every sample, or no samples).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
STATUSES = ("pass", "fail", "error", "crash", "skip")
RTOL = 1e-5
ATOL = 1e-5
MSG_LIMIT = 600


def short(exc: BaseException, limit: int = MSG_LIMIT) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in tensors_of(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors_of(x)]
    return []


def to_device(obj: Any, device: str, memo: dict[int, Any] | None = None) -> Any:
    """Copy tensors (keeping requires_grad as leaves); the same tensor maps to the same copy."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            t = obj.detach().to(device, copy=True)
            memo[id(obj)] = t.requires_grad_(obj.requires_grad) if obj.requires_grad else t
        return memo[id(obj)]
    if isinstance(obj, list):
        return [to_device(x, device, memo) for x in obj]
    if isinstance(obj, tuple):
        items = [to_device(x, device, memo) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: to_device(v, device, memo) for k, v in obj.items()}
    return obj


def compare(expected: Any, actual: Any, device_type: str, path: str) -> str | None:
    exp, act = tensors_of(expected), tensors_of(actual)
    if len(exp) != len(act):
        return f"{path}: {len(act)} tensors, expected {len(exp)}"
    for k, (e, a) in enumerate(zip(exp, act)):
        where = f"{path}[{k}]"
        if a.device.type != device_type:
            return f"{where}: on {a.device}, expected device type {device_type!r}"
        if a.dtype != e.dtype or a.shape != e.shape:
            return f"{where}: {a.dtype}{tuple(a.shape)}, expected {e.dtype}{tuple(e.shape)}"
        try:
            torch.testing.assert_close(a.detach().cpu(), e.detach(), rtol=RTOL, atol=ATOL, equal_nan=True,
                                       check_device=False, check_stride=False, check_layout=False)
        except AssertionError as exc:
            return f"{where}: " + str(exc).strip().replace("\n", " ")[:MSG_LIMIT]
    return None


# --------------------------------------------------------------------------------------------------
# generic driver (shared with optim_sweep.py)


def chunk_of(items: Sequence, chunk: int, nchunks: int) -> list:
    return [item for k, item in enumerate(items) if k % nchunks == chunk]


def _read_progress(path: Path) -> tuple[dict[str, dict], str | None]:
    results: dict[str, dict] = {}
    running = None
    if not path.exists():
        return results, None
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "start" in ev:
            running = ev["start"]
        elif "result" in ev:
            results[ev["result"]["id"]] = ev["result"]
            running = None
    return results, running


def _run_chunk(module: str, ids: list[str], device: str, preload: list[str], timeout_s: float,
               startup_timeout_s: float, workdir: Path, tag: str, extra: list[str]) -> tuple[list[dict], int]:
    """Run ``ids`` in children until each has a result; returns (results, number of children)."""
    results: list[dict] = []
    todo = list(ids)
    children = 0
    while todo:
        ids_file = workdir / f"{tag}_{children}.ids.json"
        progress = workdir / f"{tag}_{children}.progress"
        ids_file.write_text(json.dumps(todo))
        cmd = [sys.executable, "-m", module, "--device", device, "--ids-file", str(ids_file),
               "--progress", str(progress), "--preload", ",".join(preload), *extra]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        log = open(workdir / f"{tag}_{children}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        children += 1
        last_change, last_size, timed_out = time.monotonic(), -1, False
        while proc.poll() is None:
            time.sleep(0.2)
            size = progress.stat().st_size if progress.exists() else 0
            if size != last_size:
                last_size, last_change = size, time.monotonic()
            done, running = _read_progress(progress)
            limit = timeout_s if running else startup_timeout_s
            if time.monotonic() - last_change > limit:
                proc.kill()
                proc.wait()
                timed_out = True
        log.close()
        done, running = _read_progress(progress)
        for i in todo:
            if i in done:
                results.append(done[i])
        if running is not None:
            rc = proc.returncode
            if timed_out:
                status, msg = "error", f"timeout: no result after {timeout_s:g} s (child killed)"
            else:
                status, msg = "crash", f"child process died (return code {rc}) while running this entry"
            results.append({"id": running, "status": status, "passed": 0, "total": 0, "message": msg})
        elif timed_out or (proc.returncode != 0 and not done):
            tail = (workdir / f"{tag}_{children - 1}.log").read_text()[-MSG_LIMIT:]
            results.append({"id": f"<{tag} startup>", "status": "crash" if not timed_out else "error",
                            "passed": 0, "total": 0, "message": f"child failed outside any entry: {tail}"})
            break
        finished = {r["id"] for r in results}
        todo = [i for i in todo if i not in finished]
    return results, children


def run_sweep(module: str, ids: list[str], device: str, *, workers: int = 2, nchunks: int | None = None,
              preload: list[str] | None = None, timeout_s: float = 120.0, startup_timeout_s: float = 600.0,
              extra: list[str] | None = None, label: str = "sweep") -> dict:
    nchunks = nchunks or max(1, workers * 2)
    preload = preload if preload is not None else (["torchneuron_lab"] if device.startswith("neuron") else [])
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"{label}_") as tmp:
        workdir = Path(tmp)
        chunks = [chunk_of(ids, c, nchunks) for c in range(nchunks)]
        out: list[list[dict]] = [[] for _ in chunks]
        children = [0]
        lock = threading.Lock()
        pending = list(range(len(chunks)))

        def worker() -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    c = pending.pop(0)
                res, n = _run_chunk(module, chunks[c], device, preload, timeout_s, startup_timeout_s, workdir,
                                    f"chunk{c}", extra or [])
                with lock:
                    out[c] = res
                    children[0] += n

        threads = [threading.Thread(target=worker) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    order = {i: k for k, i in enumerate(ids)}
    results = sorted((r for rs in out for r in rs), key=lambda r: order.get(r["id"], -1))
    counts = {s: sum(r["status"] == s for r in results) for s in STATUSES}
    runnable = counts["pass"] + counts["fail"] + counts["error"] + counts["crash"]
    rate = round(100.0 * counts["pass"] / runnable, 1) if runnable else None
    samples = sum(r["passed"] for r in results), sum(r["total"] for r in results)
    line = (f"{label}: {len(results)} entries, {counts['pass']} pass, {counts['fail']} fail, {counts['error']} error, "
            f"{counts['crash']} crash, {counts['skip']} skip; pass rate {rate}% of runnable "
            f"(pass/(pass+fail+error+crash)); samples {samples[0]}/{samples[1]} passed")
    return {"label": label, "device": device, "results": results, "summary": {**counts, "pass_rate": rate},
            "summary_line": line, "wall_time_s": time.monotonic() - t0, "child_processes": children[0]}


def write_report(report: dict, stem: str | Path) -> tuple[Path, Path]:
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(report, indent=1))
    lines = [f"# {report['label']} on {report['device']}", "", report["summary_line"], "",
             "| entry | status | samples passed/total | message |", "|---|---|---|---|"]
    for r in report["results"]:
        msg = r.get("message", "").replace("|", "\\|")[:300]
        lines.append(f"| `{r['id']}` | {r['status']} | {r['passed']}/{r['total']} | {msg} |")
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def child_main(args: argparse.Namespace, run_entry: Callable[[str, str], dict]) -> int:
    for mod in filter(None, (args.preload or "").split(",")):
        __import__(mod)
    ids = json.loads(Path(args.ids_file).read_text())
    with open(args.progress, "a") as prog:
        for i in ids:
            prog.write(json.dumps({"start": i}) + "\n")
            prog.flush()
            os.fsync(prog.fileno())
            if i == os.environ.get("TORCHNEURON_LAB_SWEEP_ABORT_IN"):  # harness test: a crashing entry
                os.abort()
            try:
                res = run_entry(i, args.device)
            except Exception as exc:  # noqa: BLE001 - a sweep records every exception
                res = {"status": "error", "passed": 0, "total": 0,
                       "message": "harness: " + short(exc) + " " + traceback.format_exc(limit=3)[-300:]}
            res["id"] = i
            prog.write(json.dumps({"result": res}) + "\n")
            prog.flush()
    return 0


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--device", default="neuron")
    p.add_argument("--only", help="comma-separated entry ids")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--report", help="report path stem (STEM.json, STEM.md)")
    p.add_argument("--preload", default=None)
    p.add_argument("--fail-under", type=float, default=None)
    p.add_argument("--list", action="store_true")
    p.add_argument("--ids-file", help="child mode: run these entry ids in-process")
    p.add_argument("--progress", help="child mode: progress file (JSON lines)")
    return p


def main_for(module: str, label: str, all_ids: Callable[[], list[str]], run_entry: Callable[[str, str], dict],
             argv: Sequence[str] | None = None) -> int:
    args = build_parser(module).parse_args(argv)
    if args.ids_file:
        return child_main(args, run_entry)
    ids = all_ids()
    if args.only:
        wanted = args.only.split(",")
        ids = [i for i in ids if i in wanted]
    if args.list:
        print("\n".join(ids))
        return 0
    preload = args.preload.split(",") if args.preload is not None else None
    report = run_sweep(module, ids, args.device, workers=args.workers, preload=preload, timeout_s=args.timeout,
                       label=label)
    report["command"] = " ".join(shlex.quote(a) for a in [sys.executable, "-m", module, *(argv or sys.argv[1:])])
    stem = args.report or REPO_ROOT / "reports" / f"{label}_{args.device.split(':')[0]}"
    _, md = write_report(report, stem)
    print(report["summary_line"])
    print(f"{label}: wall time {report['wall_time_s']:.1f} s; report {md}")
    s = report["summary"]
    if args.fail_under is not None and (s["crash"] or (s["pass_rate"] or 0.0) < args.fail_under):
        return 1
    return 0


# --------------------------------------------------------------------------------------------------
# ModuleInfo


def module_infos() -> dict[str, Any]:
    from torch.testing._internal.common_modules import module_db

    return {info.formatted_name: info for info in module_db}


def _forward_backward(info: Any, sample: Any, device: str, training: bool, seed: int) -> Any:
    """Build on CPU (seeded), copy to ``device``, forward (seeded) and backward; returns the results."""
    cargs, ckwargs = sample.constructor_input.args, sample.constructor_input.kwargs
    torch.manual_seed(seed)
    module = info.module_cls(*cargs, **ckwargs).to(torch.float32)
    module = copy.deepcopy(module).to(device) if device != "cpu" else module
    module.train(training)
    fargs = to_device(sample.forward_input.args, device)
    fkwargs = to_device(sample.forward_input.kwargs, device)
    torch.manual_seed(seed + 1)
    out = module(*fargs, **fkwargs)
    outs = [t for t in tensors_of(out) if t.requires_grad and t.is_floating_point()]
    inputs = [t for t in tensors_of((fargs, fkwargs)) if t.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    grads: tuple = ()
    if outs and (inputs or params):
        gen = torch.Generator().manual_seed(seed + 2)
        loss = sum((o * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
        grads = torch.autograd.grad(loss, inputs + params, allow_unused=True)
        grads = tuple(g if g is not None else torch.zeros(0) for g in grads)
    return out, grads, [b for b in module.buffers()]


def run_module_entry(entry: str, device: str) -> dict:
    info = module_infos()[entry]
    device_type = device.split(":")[0]
    modes = [True, False] if getattr(info, "train_and_eval_differ", False) else [True]
    passed = total = 0
    first_fail: str | None = None
    first_error: str | None = None
    cpu_errors = 0
    for training in modes:
        try:
            samples = list(info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True,
                                                   training=training))
        except Exception as exc:  # noqa: BLE001 - a sweep records every exception
            return {"status": "skip", "passed": 0, "total": 0, "message": "no samples: " + short(exc)}
        for k, sample in enumerate(samples):
            where = f"sample {k} ({'train' if training else 'eval'}): {sample.desc or ''}".strip()
            try:
                expected = _forward_backward(info, sample, "cpu", training, 1000 + k)
            except Exception:  # noqa: BLE001 - CPU raising makes the sample a skip
                cpu_errors += 1
                continue
            total += 1
            try:
                actual = _forward_backward(info, sample, device, training, 1000 + k)
            except Exception as exc:  # noqa: BLE001 - a sweep records every exception
                first_error = first_error or f"{where}: {short(exc)}"
                continue
            msg = (compare(expected[0], actual[0], device_type, "out")
                   or compare(expected[1], actual[1], device_type, "grad")
                   or compare(expected[2], actual[2], device_type, "buffer"))
            if msg:
                first_fail = first_fail or f"{where}: {msg}"
            else:
                passed += 1
    if total == 0:
        reason = f"CPU raised on all {cpu_errors} samples" if cpu_errors else "no samples"
        return {"status": "skip", "passed": 0, "total": 0, "message": reason}
    if first_error:
        return {"status": "error", "passed": passed, "total": total, "message": first_error}
    if first_fail:
        return {"status": "fail", "passed": passed, "total": total, "message": first_fail}
    return {"status": "pass", "passed": passed, "total": total, "message": ""}


def main(argv: Sequence[str] | None = None) -> int:
    return main_for("tests.conformance.module_sweep", "modules", lambda: list(module_infos()), run_module_entry,
                    argv)


if __name__ == "__main__":
    sys.exit(main())
