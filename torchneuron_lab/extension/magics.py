"""The IPython magics. Each body parses its arguments, calls one helper, and displays the result."""

from __future__ import annotations

import ast
import contextlib
import re
import shlex
import sys
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import helpers
from .cells import CellMapper, current_cell
from .interrupts import SigintGate

__all__ = ["NeuronMagics"]


def _parse(magic: Callable[..., Any], line: str) -> Any:
    """``parse_argstring`` whose ``UsageError`` carries the magic's usage line."""
    try:
        return parse_argstring(magic, line)
    except UsageError as e:
        raise UsageError(f"{e}\n{magic.parser.format_usage()}") from None  # type: ignore[attr-defined]
    except ValueError as e:  # shlex: unbalanced quotes, a trailing escape
        raise _usage(magic, f"cannot parse the arguments {line!r}: {e}") from None


def _usage(magic: Callable[..., Any], message: str) -> UsageError:
    return UsageError(f"{message}\n{magic.parser.format_usage()}")  # type: ignore[attr-defined]


def _show(result: Any, args: Any) -> Any:
    """Display unless ``-q``; return the result object with ``-o`` (like ``%timeit``)."""
    if not args.quiet:
        from IPython.display import display

        display(result)
    return result if args.output else None


def widget_front_end(shell: Any) -> bool:
    """Whether ``shell`` is a Jupyter kernel (ipykernel's ZMQ shell), whose front-end can show widgets."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        from ipykernel.zmqshell import ZMQInteractiveShell
    except ImportError:  # pragma: no cover - a broken ipykernel
        return False
    return isinstance(shell, ZMQInteractiveShell)


_common = [argument("-q", "--quiet", action="store_true", help="do not display the result"),
           argument("-o", "--output", action="store_true", help="return the result object")]
_widget_flags = [
    argument("--widget", action="store_true",
             help="display the interactive widget too (default: only in a Jupyter kernel)"),
    argument("--no-widget", action="store_true", help="never display the widget, only the tables"),
]


def _with_widget_flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    for deco in reversed(_widget_flags):
        fn = deco(fn)
    return fn


def _with_common(fn: Callable[..., Any]) -> Callable[..., Any]:
    for deco in reversed(_common):
        fn = deco(fn)
    return fn


@magics_class
class NeuronMagics(Magics):
    """``%neuron_placement``, ``%neuron_graph_breaks``, ``%neuron_subgraphs``, ``%neuron_memory``,
    ``%%neuron_profile``, ``%neuron_watch`` and ``%%neuron_ranks``."""

    shell: Any

    def __init__(self, shell: Any, mapper: CellMapper, watch: helpers.Watch) -> None:
        super().__init__(shell)
        self.mapper = mapper
        self.watch = watch

    # -- helpers ---------------------------------------------------------------------------------
    def _cell_filename(self, text: str) -> str:
        """Register ``text`` with IPython's compiler under the running cell's number; its filename."""
        name: str = self.shell.compile.cache(text, current_cell(self.shell), raw_code=text)
        return name

    def _wants_widget(self, magic: Callable[..., Any], args: Any) -> bool:
        if args.widget and args.no_widget:
            raise _usage(magic, "--widget and --no-widget exclude each other")
        if args.quiet or args.no_widget:
            return False
        return bool(args.widget) or widget_front_end(self.shell)

    def _show_widget(self, magic: Callable[..., Any], args: Any, make: Callable[[], Any]) -> None:
        """Display ``make()`` (a widget, or None for nothing to show). Without plotly/ipywidgets/anywidget
        the text summary stands alone; with ``--widget`` that is a ``UsageError``."""
        try:
            w = make()
        except ImportError as e:
            if args.widget:
                raise _usage(magic, f"the widgets need plotly, ipywidgets and anywidget: {e}") from None
            return
        if w is not None:
            from IPython.display import display

            display(w)

    def _magic_line(self, needle: str) -> int:
        """The line of the running cell that holds ``needle`` (1 when not found)."""
        raw = getattr(self.shell.history_manager, "input_hist_raw", None) or [""]
        for i, ln in enumerate(str(raw[-1]).splitlines(), 1):
            if needle in ln:
                return i
        return 1

    # -- %neuron_placement -----------------------------------------------------------------------
    @magic_arguments()
    @argument("names", nargs="*", help="variables to show (default: the whole namespace)")
    @argument("-a", "--all", action="store_true",
              help="also list every parameter, buffer and optimizer state tensor")
    @_with_common
    @line_magic
    def neuron_placement(self, line: str = "") -> Any:
        """Where every tensor, parameter, buffer, module and optimizer state lives, with per-device totals.

        Flags modules split across devices, optimizer state on another device than its parameters, and
        large CPU tensors next to neuron models.
        """
        args = _parse(self.neuron_placement, line)
        try:
            res = helpers.placement(self.shell.user_ns, args.names, args.all)
        except helpers.LabInputError as e:
            raise _usage(self.neuron_placement, str(e)) from None
        return _show(res, args)

    # -- %neuron_graph_breaks ---------------------------------------------------------------------
    @magic_arguments()
    @argument("statement", nargs="*", help="code to compile and run (line form); the cell body otherwise")
    @_with_common
    @line_cell_magic
    def neuron_graph_breaks(self, line: str = "", cell: str | None = None) -> Any:
        """Compile the code's functions with ``torch.compile(backend="neuron")``, run it once, and
        report graphs, graph breaks (reason, hint, cell/line), recompiles and ops per graph.

            %neuron_graph_breaks train_step(x)
            %%neuron_graph_breaks
            y = model(x)
        """
        flags, statement = _split_flags(self.neuron_graph_breaks, line)
        args = _parse(self.neuron_graph_breaks, " ".join(flags))
        if cell is not None:
            if statement.strip():
                raise _usage(self.neuron_graph_breaks, "the cell form takes no statement on the magic line")
            code, first = self.shell.transform_cell(cell), 2
            text = f"%%neuron_graph_breaks {line}\n{cell}"
        else:
            if not statement.strip():
                raise _usage(self.neuron_graph_breaks, "give a statement, e.g. %neuron_graph_breaks f(x)")
            code, first = statement, self._magic_line(statement.strip())
            text = "\n" * (first - 1) + statement
        filename = self._cell_filename(text)
        from ..compiler.capture import quiet_dynamo

        __tracebackhide__ = True
        try:
            with quiet_dynamo() as dyn:  # Dynamo's own "Graph break" warnings: the table says the same
                res = helpers.graph_breaks(code, first, filename, self.shell.user_ns)
        except helpers.LabInputError as e:
            raise _usage(self.neuron_graph_breaks, str(e)) from None
        except Exception as e:  # noqa: BLE001 - the user's statement raised: its own frames only, as %%neuron_profile
            raise e.with_traceback(_user_traceback(e.__traceback__, filename))
        res.dynamo_log = dyn.text
        return _show(res, args)

    # -- %neuron_subgraphs -------------------------------------------------------------------------
    @magic_arguments()
    @argument("id", nargs="?", type=int, help="one graph's id (see the list)")
    @argument("--code", action="store_true", help="show the graph's FX code")
    @argument("--kernels", action="store_true", help="list the graph's kernels")
    @argument("--clear", action="store_true", help="forget every record (compiled code keeps running)")
    @_with_widget_flags
    @_with_common
    @line_magic
    def neuron_subgraphs(self, line: str = "") -> Any:
        """The JIT's subgraph registry: every compiled graph, or one graph's FX code, guards, kernels,
        compile-time split, calls and fallbacks. For one graph, a Jupyter kernel also shows the
        SubgraphWidget (FX code highlighted, kernels, guards)."""
        args = _parse(self.neuron_subgraphs, line)
        wants = self._wants_widget(self.neuron_subgraphs, args)
        try:
            res = helpers.subgraphs(args.id, args.code, args.kernels, args.clear)
        except helpers.LabInputError as e:
            raise _usage(self.neuron_subgraphs, str(e)) from None
        out = _show(res, args)
        if wants and (res.detail is not None or res.records):
            self._show_widget(self.neuron_subgraphs, args, res.widget)
        return out

    # -- %neuron_memory -----------------------------------------------------------------------------
    @magic_arguments()
    @argument("-d", "--device", type=int, default=None, help="device index (default 0)")
    @argument("--segments", action="store_true", help="show the segment/block map")
    @argument("--history", action="store_true",
              help="show recent allocator events (turns history recording on if it is off)")
    @argument("--reset-peak", action="store_true", help="reset the peak statistics afterwards")
    @argument("--snapshot", metavar="FILE", default=None,
              help="write the allocator snapshot (pickle, for pytorch.org/memory_viz) to FILE")
    @_with_widget_flags
    @_with_common
    @line_magic
    def neuron_memory(self, line: str = "") -> Any:
        """Allocator state: stats, top live allocations by source line, segments, fragmentation, and
        after an out-of-memory error the state at that moment and why it failed. When allocator
        history exists, a Jupyter kernel also shows the MemoryWidget under the tables."""
        args = _parse(self.neuron_memory, line)
        wants = self._wants_widget(self.neuron_memory, args)
        try:
            res = helpers.memory(args.device, args.segments, args.history, args.reset_peak, args.snapshot,
                                 self.mapper)
        except helpers.LabInputError as e:
            raise _usage(self.neuron_memory, str(e)) from None
        except OSError as e:
            raise _usage(self.neuron_memory, f"cannot write the snapshot: {e}") from None
        out = _show(res, args)
        if wants:
            self._show_widget(self.neuron_memory, args, res.widget)
        return out

    # -- %%neuron_profile ---------------------------------------------------------------------------
    @magic_arguments()
    @argument("--compile", action="store_true", help="also list compile events (graphs, graph breaks)")
    @argument("--memory", action="store_true",
              help="reset peak memory first (the peak is the cell's) and record allocator history during the "
                   "cell for the memory widget")
    @argument("--record-shapes", action="store_true", help="record input shapes and dtypes of each kernel")
    @argument("-k", "--top", type=int, default=10, help="kernels to list (default 10)")
    @argument("-T", "--export", metavar="FILE", default=None, help="write the events as Chrome trace JSON")
    @_with_widget_flags
    @_with_common
    @cell_magic
    def neuron_profile(self, line: str = "", cell: str = "") -> Any:
        """Run the cell with the device recorder on; show time by engine, top kernels, host syncs and
        transfers with their cell lines, new op signatures and memory. In a Jupyter kernel the
        interactive kernel timeline (TimelineWidget) is shown above the tables, and with ``--memory``
        the MemoryWidget below them. The result is stored as ``_neuron_profile`` (events as plain data:
        ``.to_dataframe()``, ``.to_chrome_trace()``; ``.timeline_figure()``, ``.widget()``,
        ``.memory_widget()``)."""
        __tracebackhide__ = True  # IPython hides this frame in the user's traceback  # noqa: F841
        args = _parse(self.neuron_profile, line)
        wants = self._wants_widget(self.neuron_profile, args)
        if args.top < 0:
            raise _usage(self.neuron_profile, f"--top must be >= 0, got {args.top}")
        export = _check_output_path(self.neuron_profile, args.export, "--export")  # before the cell runs
        filename = self._cell_filename(f"%%neuron_profile {line}\n{cell}")
        try:
            tree = self.shell.compile.ast_parse("\n" + self.shell.transform_cell(cell), filename=filename)
        except SyntaxError as e:  # the cell fails, as with IPython's %%time and %%timeit ("Run all" stops)
            raise e.with_traceback(None) from None  # without the parser's frames
        gate = SigintGate()
        with gate:  # Ctrl-C during the lab's set-up/tear-down is deferred; the cell itself stays interruptible
            self.watch.suspend()
            try:
                # with --compile the lab's tables show graphs and breaks: Dynamo's printed copy is captured
                quiet = _quiet_dynamo() if args.compile else contextlib.nullcontext()
                with quiet:
                    res, value, error = helpers.profile_cell(_runner(self.shell, tree, filename, gate),
                                                             record_shapes=args.record_shapes,
                                                             memory_peak=args.memory, top=args.top)
            except helpers.LabInputError as e:  # raised before the cell ran (a profile already recording)
                raise _usage(self.neuron_profile, str(e)) from None
            finally:
                self.watch.resume()
        if gate.pending and error is None:
            error = KeyboardInterrupt()
        self.watch.note_profiled(res)
        if not args.compile:
            res.new_subgraphs, res.graph_breaks = [], []
        self.shell.user_ns["_neuron_profile"] = res
        if export is not None:
            try:
                res.export(export)
            except (OSError, ValueError) as e:
                if error is None:
                    raise _usage(self.neuron_profile, f"cannot export to {args.export!r}: {e}") from None
                print(f"neuron_profile: cannot export to {args.export!r}: {e}", file=sys.stderr)
        if error is None and value is not None:
            from IPython.display import display

            display(value)
        if wants and res.events:
            self._show_widget(self.neuron_profile, args, res.widget)
        out = _show(res, args)
        if wants and args.memory:
            self._show_widget(self.neuron_profile, args, res.memory_widget)
        if error is not None:
            # The cell failed: propagate its exception as IPython's own cell magics do (so that the cell
            # is marked failed and "Run all" stops), with the user's frames only.
            raise error.with_traceback(_user_traceback(error.__traceback__, filename))
        return out

    # -- %%neuron_ranks ------------------------------------------------------------------------------
    @magic_arguments()
    @argument("-n", "--nproc", type=int, default=2, help="number of ranks (default 2)")
    @argument("-t", "--timeout", type=float, default=300.0,
              help="seconds for all ranks together (default 300); then every rank still running is killed")
    @argument("--backend", default="neuron",
              help="process-group backend (default neuron: neuron and CPU tensors; gloo: CPU tensors only)")
    @_with_common
    @cell_magic
    def neuron_ranks(self, line: str = "", cell: str = "") -> Any:
        """Run the cell as the ranks of a torch.distributed job on this machine, as torchrun would: each rank
        a fresh interpreter with the process group made (``rank``, ``world_size`` and ``dist`` defined), the
        group destroyed after it. The cell is plain Python and self-contained (the notebook's variables are
        not in the ranks). Shows each rank's output; the cell fails if a rank fails or the time runs out, and
        every rank still running is then killed (Ctrl-C too). The result is stored as ``_neuron_ranks``."""
        __tracebackhide__ = True
        from ..distributed.launch import run_ranks

        args = _parse(self.neuron_ranks, line)
        if args.nproc < 1:
            raise _usage(self.neuron_ranks, f"-n must be >= 1, got {args.nproc}")
        if not args.timeout > 0:
            raise _usage(self.neuron_ranks, f"-t must be > 0 seconds, got {args.timeout}")
        res = run_ranks(cell, args.nproc, timeout=args.timeout, backend=args.backend,
                        filename=f"cell [{current_cell(self.shell)}]")
        self.shell.user_ns["_neuron_ranks"] = res
        out = _show(res, args)
        if not res.ok:
            raise RuntimeError(f"%%neuron_ranks: {res.failure()}")
        return out

    # -- %neuron_watch ------------------------------------------------------------------------------
    @magic_arguments()
    @argument("state", nargs="?", choices=("on", "off"), help="turn ambient mode on or off")
    @line_magic
    def neuron_watch(self, line: str = "") -> None:
        """Ambient mode: after every cell, one line with kernels run, new signatures, host syncs, graph
        breaks and memory per device, only when the cell did something."""
        args = _parse(self.neuron_watch, line)
        if args.state is None:
            print(f"neuron_watch is {'on' if self.watch.active else 'off'}")
            return
        set_watch(self.shell, self.watch, args.state == "on")
        print(f"neuron_watch {args.state}")


def _split_flags(magic: Callable[..., Any], line: str) -> tuple[list[str], str]:
    """Leading ``-q``/``-o`` flags, and the rest of the line verbatim. A leading word shaped like an option
    (``-x``, ``--bogus``) that is not one is a ``UsageError`` with the magic's usage line; a statement that
    starts with a minus (``-f(x)``) is a statement."""
    flags: list[str] = []
    rest = line.lstrip()
    while rest.startswith("-"):
        tok = rest.split(None, 1)[0]
        if tok not in ("-q", "-o", "--quiet", "--output", "-qo", "-oq"):
            break
        flags.append(tok)
        rest = rest[len(tok):].lstrip()
    if rest and re.fullmatch(r"--?[A-Za-z][\w-]*", rest.split(None, 1)[0]):
        raise _usage(magic, f"unknown option {rest.split(None, 1)[0]!r} in {shlex.quote(line)}")
    return flags, rest


def _quiet_dynamo() -> Any:
    from ..compiler.capture import quiet_dynamo

    return quiet_dynamo()


def _check_output_path(magic: Callable[..., Any], path: str | None, flag: str) -> str | None:
    """``path`` made absolute, after checking that its folder exists and is writable (``UsageError``)."""
    if path is None:
        return None
    import os

    full = os.path.abspath(os.path.expanduser(path))
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise _usage(magic, f"cannot export to {path!r}: it is a directory")
    if not os.path.isdir(folder):
        raise _usage(magic, f"cannot export to {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise _usage(magic, f"cannot export to {path!r}: the folder {folder!r} is not writable")
    return full


def _user_traceback(tb: Any, filename: str) -> Any:
    """``tb`` without its leading frames of the lab: it starts at the first frame of the user's cell."""
    cur = tb
    while cur is not None and cur.tb_frame.f_code.co_filename != filename:
        cur = cur.tb_next
    return cur if cur is not None else tb


def _runner(shell: Any, tree: ast.Module, filename: str, gate: SigintGate | None = None) -> Callable[[], Any]:
    """Run the cell's statements in the user namespace; returns the value of a last expression. With a
    ``gate``, Ctrl-C is let through only while the statements run."""

    def run() -> Any:
        __tracebackhide__ = True  # noqa: F841
        if gate is not None:
            with gate.open():
                return run_body()
        return run_body()

    def run_body() -> Any:
        __tracebackhide__ = True  # noqa: F841
        body = list(tree.body)
        last = body.pop() if body and isinstance(body[-1], ast.Expr) else None
        assert last is None or isinstance(last, ast.Expr)
        if body:
            code = compile(ast.Module(body=body, type_ignores=[]), filename, "exec")
            exec(code, shell.user_ns)  # noqa: S102 - the user's own cell
        if last is not None:
            return eval(compile(ast.Expression(last.value), filename, "eval"), shell.user_ns)
        return None

    return run


def set_watch(shell: Any, watch: helpers.Watch, on: bool) -> None:
    """Register or remove the ambient-mode hooks (idempotent)."""
    if on and not watch.active:
        shell.events.register("pre_run_cell", watch.pre_run_cell)
        shell.events.register("post_run_cell", watch.post_run_cell)
        watch.active = True
        watch.pre_run_cell(None)  # count from now: the rest of this cell is watched too
    elif not on and watch.active:
        for name, cb in (("pre_run_cell", watch.pre_run_cell), ("post_run_cell", watch.post_run_cell)):
            try:
                shell.events.unregister(name, cb)
            except ValueError:
                pass
        watch.active = False
        watch.release()
