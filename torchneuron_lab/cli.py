"""``torchneuron-lab``: command-line entry point.

- ``torchneuron-lab info``  devices, profile, capacity, build status of the C++ core, versions.
- ``torchneuron-lab demo``  the main job on the embedded emulated device: trains a small model on
  ``neuron`` with the kernel recorder on, prints the allocator state and a kernel summary, writes a
  Chrome/Perfetto trace and the memory snapshot, then runs the bundled quickstart notebook headless
  (nbclient) and writes it as one self-contained, offline HTML report; prints the paths.
- ``torchneuron-lab profile script.py [args...] [-o report.html] [--trace trace.json]``  runs a plain
  Python script with the kernel recorder on and prints the ``%%neuron_profile`` summary; writes the
  timeline figure (offline HTML) and the Chrome trace when asked. Script arguments that start with ``-``
  go after ``--``. Output paths are checked and made absolute before the script runs. A failing script
  prints its traceback and exits non-zero; Ctrl-C (SIGINT) stops the script, writes the partial profile
  and exits 130. Recording is bounded: the recorder keeps the first and the newest events of a long run
  (and says how many it dropped), the allocator history keeps its newest entries.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import runpy
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (typing.Self is Python 3.11's; the annotations are not evaluated at run time)
    from typing_extensions import Self


class _Interrupted:
    """SIGINT and SIGTERM raise KeyboardInterrupt while installed, remembering which came (a job scheduler,
    ``timeout`` and CI stop a run with SIGTERM: it gets what Ctrl-C gets); restored on exit."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._saved: dict[int, object] = {}

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signal = signum
        raise KeyboardInterrupt

    def __enter__(self) -> Self:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "SIGINT"

    @property
    def exit_code(self) -> int:
        return 128 + (self.signal or signal.SIGINT)


def _info(_: argparse.Namespace) -> int:
    import torch

    import torchneuron_lab
    from torchneuron_lab.device import _backend, current_config, profile

    cfg = current_config()
    prof = profile()
    print(f"torchneuron_lab {torchneuron_lab.__version__}  torch {torch.__version__}  python {sys.version.split()[0]}")
    print(f"device: neuron (emulated NeuronCore, kernels on host CPU), {cfg['num_devices']} devices")
    print(f"HBM per device: {cfg['hbm_bytes'] / 2**30:.2f} GiB  profile: {prof.name}")
    info = _backend.build_info()
    print(f"C++ core: {'cached build' if info.get('cached') else 'built now'} in {info.get('build_dir')} "
          f"({float(info.get('seconds', 0.0)):.1f} s)")
    print(f"torch.accelerator: {torch.accelerator.current_accelerator()}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    import torch

    import torchneuron_lab  # noqa: F401  (registers the device)
    from torchneuron_lab.device import recorder
    from torchneuron_lab.tracing import summarize, write_chrome_trace
    from torchneuron_lab.tracing.events import displayable

    out = Path(args.output).expanduser().absolute() if args.output else Path(
        tempfile.mkdtemp(prefix="torchneuron_lab_demo_"))
    try:  # before the run: a bad directory fails at once, not after the training
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"{out} exists and is not a directory")
        out.mkdir(parents=True, exist_ok=True)
        for name in ("trace.json", "memory_snapshot.pickle", "summary.json", "quickstart_report.html"):
            if (out / name).is_dir():
                raise IsADirectoryError(f"{out / name} is a directory (the demo writes a file there)")
        if not os.access(out, os.W_OK | os.X_OK):
            raise PermissionError(f"{out} is not writable")
    except OSError as e:
        print(f"torchneuron-lab demo: error: -o/--output: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512), torch.nn.Linear(512, 10)
    ).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(64, 256).to("neuron")
    y = torch.randint(0, 10, (64,)).to("neuron")
    torch.neuron.memory._record_memory_history(max_entries=100000)
    t0 = time.perf_counter()
    with recorder.record(with_stack=True) as box:
        for step in range(args.steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            print(f"step {step}: loss {loss.item():.4f}")
    wall = time.perf_counter() - t0
    trace = box[0]
    summary = summarize(trace.events, k=8)
    print(f"\n{len(trace.events)} device events in {wall:.2f} s ({trace.dropped} dropped)")
    print("time by engine (measured on the host; est = roofline ESTIMATE for " + str(trace.profile) + "):")
    for eng, row in summary["time_by_engine"].items():
        print(f"  {eng:7s} {row['count']:6d} events  {row['total_ns'] / 1e6:9.3f} ms")
    print("top kernels:")
    for row in summary["top_kernels"]:
        print(f"  {row['name']:40s} x{row['count']:<5d} {row['total_ns'] / 1e6:9.3f} ms")
    print(f"host syncs: {len(summary['sync_events'])}   new op signatures: {len(summary['new_signatures'])}")
    print()
    print(torch.neuron.memory_summary(abbreviated=True))
    trace_path = out / "trace.json"
    write_chrome_trace(trace_path, trace.events, {"profile": trace.profile})
    snap_path = out / "memory_snapshot.pickle"
    torch.neuron.memory._dump_snapshot(str(snap_path))
    torch.neuron.memory._record_memory_history(enabled=None)
    (out / "summary.json").write_text(json.dumps(summary, default=str, indent=1))
    print(displayable(f"wrote {trace_path} (open in Perfetto / chrome://tracing), {snap_path} "
                      f"(pytorch.org/memory_viz), {out / 'summary.json'}"))
    if args.no_report:
        return 0
    print("\nrunning the quickstart notebook headless ...", flush=True)
    t0 = time.perf_counter()
    with _Interrupted() as stop:
        try:
            report = run_notebook_report(QUICKSTART, out / "quickstart_report.html", cwd=out)
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - say which, keep the outputs written so far
            if stop.signal is not None or isinstance(e, KeyboardInterrupt):
                # (while nbclient runs, it takes the signal: which one is not known, and the exit code is Ctrl-C's)
                what = stop.name if stop.signal is not None else "a signal"
                print(f"torchneuron-lab demo: interrupted ({what}) while running the quickstart notebook; "
                      "the trace, snapshot and summary above are written, the report is not", file=sys.stderr)
                return stop.exit_code
            print(f"the quickstart notebook failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    print(displayable(f"wrote the HTML report {report} ({time.perf_counter() - t0:.1f} s)"))
    return 0


QUICKSTART = "01_quickstart.ipynb"
_REMOTE_SCRIPT = re.compile(r"<script[^>]*\bsrc=[\"']https?://[^>]*>\s*</script>", re.IGNORECASE)


def bundled_notebook(name: str) -> Path:
    """Path of a notebook shipped inside the package (``torchneuron_lab/notebooks``)."""
    from importlib import resources

    path = Path(str(resources.files("torchneuron_lab.notebooks") / name))
    if not path.is_file():
        raise FileNotFoundError(f"notebook {name} is not bundled with this installation ({path})")
    return path


def run_notebook_report(name: str, html_path: Path, *, cwd: Path, timeout: int = 300) -> Path:
    """Execute a bundled notebook in a fresh python3 kernel and write it as self-contained HTML.

    The figures are in the notebook as static HTML with plotly.js inlined; remote ``<script src>`` tags of
    the nbconvert template (require.js, MathJax, the widget manager) are dropped, so the report loads
    nothing from the network.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    nb = nbformat.read(bundled_notebook(name), as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=False,
                            resources={"metadata": {"path": str(cwd)}})
    try:
        client.execute()
    except BaseException as e:
        # nbclient takes SIGINT and SIGTERM itself while it runs (it shuts the kernel down, and the run then fails
        # with an AssertionError or asyncio's CancelledError): its cleanup future says a signal came
        if getattr(client, "_async_cleanup_kernel_future", None) is not None or isinstance(e, KeyboardInterrupt):
            raise KeyboardInterrupt from e
        raise
    exporter = HTMLExporter(embed_images=True)
    body, _ = exporter.from_notebook_node(nb)
    from torchneuron_lab.tracing.chrome_trace import write_atomically
    from torchneuron_lab.widgets.figures import _CDN_TOPOJSON

    body = _REMOTE_SCRIPT.sub("", body).replace(_CDN_TOPOJSON, '"topojson/"')
    data = body.encode("utf-8", errors="replace")
    return write_atomically(html_path, lambda fh: fh.write(data))


def _user_traceback(exc: BaseException, script: Path) -> str:
    """The exception's traceback from the script's first frame on (the lab's own frames dropped)."""
    tb = exc.__traceback__
    target = str(script.resolve())
    while tb is not None and str(Path(tb.tb_frame.f_code.co_filename).resolve()) != target:
        tb = tb.tb_next
    if tb is None and isinstance(exc, SyntaxError):
        # raised compiling the script (no frame of it ran): the error alone, as ``python script.py`` prints it
        return "".join(traceback.format_exception_only(type(exc), exc))
    return "".join(traceback.format_exception(type(exc), exc, tb if tb is not None else exc.__traceback__))


def output_path(value: str | None, option: str) -> Path | None:
    """``value`` as an absolute path whose file can be written, checked now (before any work is done).

    Raises:
        ValueError: the directory does not exist or is not writable, or the path is a directory.
    """
    if value is None:
        return None
    if value == "-":
        raise ValueError(f"{option} -: standard output is not supported (the summary is printed there); "
                         "give a file name")
    path = Path(value).expanduser().absolute()
    if path.is_dir():
        raise ValueError(f"{option} {value}: is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {value}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{option} {value}: not writable")
    return path


def _same_file(a: Path, b: Path) -> bool:
    """``a`` and ``b`` name one file (symlinks and hard links followed; either may not exist yet)."""
    try:
        if os.path.samefile(a, b):
            return True
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _distinct_outputs(script: Path, report: Path | None, trace: Path | None) -> None:
    """Refuse, before the run, outputs that would overwrite each other or the script.

    Raises:
        ValueError: naming the two options.
    """
    if report is not None and trace is not None and _same_file(report, trace):
        raise ValueError(f"-o/--output and --trace name the same file ({report}): the report would replace "
                         "the trace")
    for path, option in ((report, "-o/--output"), (trace, "--trace")):
        if path is not None and _same_file(path, script):
            raise ValueError(f"{option} {path}: is the script being profiled; give another file name")


def _dropped_line(trace: object) -> str | None:
    dropped = int(getattr(trace, "dropped", 0))
    if not dropped:
        return None
    window = getattr(trace, "metadata", {}).get("dropped_window_ns")
    start = getattr(trace, "start_ns", None)
    where = ""
    if window and start is not None:
        where = f" between {(window[0] - start) / 1e9:.3f} s and {(window[1] - start) / 1e9:.3f} s"
    return (f"  recording bounded: kept the first and the newest events, dropped {dropped:,} events{where} "
            f"(the run's start and end are complete)")


def _profile(args: argparse.Namespace) -> int:
    script = Path(args.script)  # an existing file (checked by main)
    if args.top < 0:
        print(f"torchneuron-lab profile: error: --top must be >= 0, got {args.top}", file=sys.stderr)
        return 2
    try:  # checked and made absolute now: a script that fails late or chdirs does not lose the report
        report_path = output_path(args.output, "-o/--output")
        trace_path = output_path(args.trace, "--trace")
        _distinct_outputs(script, report_path, trace_path)
    except ValueError as e:
        print(f"torchneuron-lab profile: error: {e}", file=sys.stderr)
        return 2
    script = script.absolute()

    import torchneuron_lab  # noqa: F401  (registers the device)
    from torchneuron_lab.extension.helpers import profile_cell
    from torchneuron_lab.tracing.events import displayable

    saved_argv, saved_path, saved_cwd = sys.argv[:], sys.path[:], os.getcwd()
    sys.argv = [str(args.script), *args.args]
    sys.path.insert(0, str(script.resolve().parent))  # as ``python script.py`` does
    exit_code = 0
    # Ctrl-C (and SIGTERM) raise KeyboardInterrupt in the script, even if our parent ignored SIGINT
    stop = _Interrupted().__enter__()

    def run() -> None:  # the path as given, so tracebacks read as with ``python script.py``
        runpy.run_path(str(args.script), run_name="__main__")

    try:
        res, _, error = profile_cell(run, record_shapes=args.record_shapes, memory_peak=True, top=args.top)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
        _usable_stdio()  # the script may have closed or replaced sys.stdout
    sys.stdout.flush()
    if isinstance(error, SystemExit):
        code = error.code
        exit_code = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
        if exit_code == 0:
            res.error = None
    elif isinstance(error, KeyboardInterrupt):
        exit_code = stop.exit_code
        print(f"torchneuron-lab profile: interrupted ({stop.name}): writing the partial profile", file=sys.stderr)
    elif error is not None:
        sys.stderr.write(_user_traceback(error, script))
        exit_code = 1
    written = None
    try:  # the files first: printing the summary can fail (a closed or broken stdout) without losing them
        if trace_path is not None:
            res.export(str(trace_path))
        if report_path is not None:
            from torchneuron_lab.widgets import save_html, timeline_figure

            # plotly draws a title's tags (<b>, <br>...): the script's name is text
            name = displayable(script.name)
            fig = timeline_figure(res.trace, title=f"{html.escape(name)}: kernel timeline")
            written = save_html(fig, str(report_path), title=f"torchneuron-lab profile {name}")
    except (OSError, UnicodeError) as e:
        print(f"torchneuron-lab profile: cannot write the output: {e}", file=sys.stderr)
        exit_code = exit_code or 1
    finally:
        stop.__exit__()
    try:
        print(res)
        dropped = _dropped_line(res.trace)
        if dropped:
            print(dropped)
        if written is not None:
            print(f"  timeline figure written to {displayable(str(written))}")
        sys.stdout.flush()
    except (OSError, ValueError) as e:  # stdout closed, or a broken pipe
        print(f"torchneuron-lab profile: cannot print the summary to standard output: {e}", file=sys.stderr)
        exit_code = exit_code or 1
    return exit_code


def _usable_stdio() -> None:
    """A standard stream the script closed is opened again on its file descriptor (the summary and errors
    still print), and unencodable characters are escaped, not fatal (``PYTHONIOENCODING=ascii``)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None or getattr(stream, "closed", False):
            try:
                stream = open(fd, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115 - the process's own
            except OSError:
                continue
            setattr(sys, name, stream)
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    _usable_stdio()
    parser = argparse.ArgumentParser(
        prog="torchneuron-lab",
        description="The torchneuron_lab command line: device info, the demo job, profiling a script.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="devices, profile, capacity, C++ core build status, versions")
    p_info.set_defaults(fn=_info)
    p_demo = sub.add_parser("demo", help="run the main job on the emulated device and write its trace")
    p_demo.add_argument("-o", "--output",
                        help="directory for the trace, snapshot and HTML report (default: a new temp dir)")
    p_demo.add_argument("--steps", type=_positive_int, default=5, help="training steps (default 5, at least 1)")
    p_demo.add_argument("--no-report", action="store_true",
                        help="skip the notebook HTML report (trace and snapshot only)")
    p_demo.set_defaults(fn=_demo)
    p_prof = sub.add_parser(
        "profile", help="run a Python script with the kernel recorder on and print the profile summary",
        description="Run a Python script on the emulated neuron device with the kernel recorder on (like "
                    "%%neuron_profile) and print the summary. Script arguments that start with '-' go after "
                    "'--': torchneuron-lab profile script.py -- --lr 0.1")
    # optional here, required below: argparse would name the optional `args` as required too
    p_prof.add_argument("script", nargs="?", help="the Python script to run (as __main__, with sys.argv set)")
    p_prof.add_argument("args", nargs="*", help="arguments passed to the script")
    p_prof.add_argument("-o", "--output", metavar="REPORT.html", help="write the timeline figure as offline HTML")
    p_prof.add_argument("--trace", metavar="TRACE.json", help="write the events as Chrome/Perfetto trace JSON")
    p_prof.add_argument("-k", "--top", type=int, default=10, help="kernels to list (default 10)")
    p_prof.add_argument("--record-shapes", action="store_true", help="record input shapes of each kernel")
    p_prof.set_defaults(fn=_profile)
    # Everything after the first "--" is the script's, split off before argparse sees it: argparse gives a
    # "--" that follows an option of ours (`profile s.py -k 5 -- --lr 0.1`) back as an unknown argument.
    argv = list(sys.argv[1:] if argv is None else argv)
    tail: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1:]
    args, unknown = parser.parse_known_args(argv)
    if tail and args.command != "profile":
        parser.error(f"unrecognized arguments: -- {' '.join(tail)}")
    if args.command == "profile":
        if args.script is None and tail:  # `profile -- s.py --lr 0.1`
            args.script, tail = tail[0], tail[1:]
        args.args = [*args.args, *tail]
        if args.script is None:
            p_prof.error("the following arguments are required: script")
        script = Path(args.script)
        if script.is_dir():
            p_prof.error(f"{args.script} is a directory, not a Python script")
        if not script.exists():  # a pipe or a device (/dev/stdin, <(...)) is a script too, as for python
            p_prof.error(f"no such script: {args.script}")
        if script.suffix == ".ipynb":
            p_prof.error(f"{args.script} is a Jupyter notebook: profile its cells with %%neuron_profile in Jupyter, "
                         "or convert it first (jupyter nbconvert --to script)")
    if unknown:
        if args.command == "profile":
            extra = " ".join(unknown)
            p_prof.error(f"unrecognized arguments: {extra}. Arguments for the script go after '--', e.g. "
                         f"torchneuron-lab profile {args.script} -- {' '.join([*args.args, *unknown])}")
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    # Registered here, after the arguments: `--help` and usage errors do not build the C++ core (the
    # package's import left it to us, torchneuron_lab._command_line_starting).
    try:
        import torchneuron_lab

        torchneuron_lab.register_device()
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        print(f"torchneuron-lab: the neuron device could not be registered: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:  # a second Ctrl-C while the partial profile is written
        print("torchneuron-lab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
