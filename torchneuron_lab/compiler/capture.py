"""Ambient capture of Dynamo's graph breaks, recompiles and guards.

Graph breaks are taken where Dynamo decides them, not from its logs: ``InstructionTranslatorBase.
log_graph_break`` (every break Dynamo takes, once per exception) and ``Unsupported.add_to_stats`` (the
``torch._dynamo.utils.counters`` entry it counts the break under) are wrapped while capture is
installed, so no logging configuration (``logging.disable``, a notebook's ``basicConfig``, handlers,
levels) can hide a break, and the lab's counts equal Dynamo's counters. Recompiles and guards are taken
the same way: ``convert_frame.get_and_maybe_log_recompilation_reasons`` (Dynamo computes the failed
guards of every recompile, whatever the logging, and only then decides whether to log them) and
``CheckFunctionManager.__init__`` (the guard tree Dynamo built for a compile; the ``guards`` artifact
logs the same text). Each record carries Dynamo's own reason/explanation/hint text, the user location,
and the compile id.

:func:`quiet_dynamo` keeps what Dynamo and Inductor print (e.g. the ``W1203 ... Graph break from
Tensor.item()`` warning block) out of the output while code runs, and keeps it for the caller.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = [
    "DynamoOutput",
    "GraphBreak",
    "Recompile",
    "clear",
    "graph_breaks",
    "guards_for",
    "install",
    "is_installed",
    "quiet_dynamo",
    "recompiles",
    "set_location_mapper",
    "uninstall",
]


@dataclass
class GraphBreak:
    """One graph break: where, why, and Dynamo's explanation and hint."""

    reason: str
    filename: str
    line: int
    location: str
    explanation: str = ""
    hints: list[str] = field(default_factory=list)
    compile_id: str | None = None
    function: str | None = None
    count: int = 1
    message: str = ""
    #: where ``torch._dynamo.utils.counters`` counts this break: ``counters[counter][counter_key]``.
    #: ``"graph_break"`` for breaks Dynamo resumes after; a data-dependent jump is counted by Dynamo
    #: only as ``"unimplemented"``.
    counter: str = "unimplemented"
    counter_key: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Recompile:
    """One recompile: the function and each guard that failed (with expected and actual values)."""

    function: str
    filename: str
    line: int
    location: str
    failures: list[str]
    compile_id: str | None = None
    message: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_lock = threading.Lock()
_breaks: list[GraphBreak] = []
_recompiles: list[Recompile] = []
_guards: dict[str, list[str]] = {}
_installed: dict[str, bool] = {}
_mapper: Callable[[str, int], str | None] | None = None

_RESUME = re.compile(r"torch_dynamo_resume_in_(?P<fn>\w+?)_at_\d+")


def set_location_mapper(fn: Callable[[str, int], str | None] | None) -> None:
    """Install the function naming a (filename, line) for display, e.g. ``'cell [3], line 2'``."""
    global _mapper
    _mapper = fn


def _location(filename: str, line: int) -> str:
    if _mapper is not None:
        mapped = _mapper(filename, line)
        if mapped:
            return mapped
    return f"{filename}:{line}"


def _compile_id() -> str | None:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - outside a compile
        return None
    return None if cid is None else str(cid)


def _break_from_exc(exc: BaseException) -> GraphBreak | None:
    """A GraphBreak from the exception Dynamo is breaking the graph on (its text and user stack)."""
    stack = getattr(exc, "real_stack", None)
    if not stack:
        try:
            from torch._guards import TracingContext

            stack = TracingContext.extract_stack()
        except Exception:  # noqa: BLE001
            stack = None
    if not stack:
        return None
    frame = stack[-1]
    msg = str(getattr(exc, "msg", None) or exc)
    lines = msg.splitlines()
    explanation = ""
    hints: list[str] = []
    for ln in lines:
        t = ln.strip()
        if t.startswith("Explanation:") and not explanation:
            explanation = t[len("Explanation:"):].strip()
        elif t.startswith("Hint:"):
            hints.append(t[len("Hint:"):].strip())
    reason = str(getattr(exc, "gb_type", "") or next((x.strip() for x in lines if x.strip()), type(exc).__name__))
    function = frame.name
    rm = _RESUME.match(function or "")
    if rm:
        function = rm.group("fn")
    filename, line = frame.filename, int(frame.lineno or 0)
    return GraphBreak(
        reason=reason,
        filename=filename,
        line=line,
        location=_location(filename, line),
        explanation=explanation,
        hints=hints,
        compile_id=_compile_id(),
        function=function,
        message=msg,
        counter=str(getattr(exc, "category", None) or "unimplemented"),
        counter_key=msg,
    )


_tls = threading.local()


def _key(b: GraphBreak) -> tuple[str, int, str, str]:
    return (b.filename, b.line, b.counter_key, b.counter)


def _merge(gb: GraphBreak) -> GraphBreak:
    """Add ``gb`` (count 1) to the record with its key, or append it; caller holds ``_lock``."""
    for prev in _breaks:
        if _key(prev) == _key(gb):
            prev.count += gb.count
            return prev
    _breaks.append(gb)
    return gb


def _note_break(exc: BaseException) -> None:
    gb = _break_from_exc(exc)
    if gb is None:
        return
    with _lock:
        gb = _merge(gb)
    _tls.last = (id(exc), gb)


def _note_counted(exc: BaseException, category: str, delta: int) -> None:
    """Dynamo moved ``exc`` into (delta=1) or out of (delta=-1) ``counters[category]``: move the one
    count this exception added to the lab's tally under the same counter."""
    if category != "graph_break":
        return
    last = getattr(_tls, "last", None)
    if last is None or last[0] != id(exc):
        return
    gb = last[1]
    with _lock:
        if delta > 0 and gb.counter != "graph_break":
            gb.count -= 1
            if gb.count <= 0 and gb in _breaks:
                _breaks.remove(gb)
            moved = replace(gb, count=1, counter="graph_break", hints=list(gb.hints))
            _tls.last = (id(exc), _merge(moved))
        elif delta < 0 and gb in _breaks:
            gb.count -= 1
            if gb.count <= 0:
                _breaks.remove(gb)
            _tls.last = None


_originals: dict[str, Any] = {}


def _hook_dynamo() -> None:
    """Wrap the two Dynamo functions that decide and count a graph break (idempotent)."""
    if _originals:
        return
    from torch._dynamo import convert_frame as cf
    from torch._dynamo import exc as dexc
    from torch._dynamo import guards as dguards
    from torch._dynamo import symbolic_convert as sc

    log_break = sc.InstructionTranslatorBase.log_graph_break
    add_stats = dexc.Unsupported.add_to_stats
    remove_stats = dexc.Unsupported.remove_from_stats

    def log_graph_break(self: Any, code_options: Any, reason: str, exc: Any) -> None:
        first = not getattr(exc, "logged", False)
        log_break(self, code_options, reason=reason, exc=exc)
        if first:
            try:
                _note_break(exc)
            except Exception:  # noqa: BLE001 - capture must never break compilation
                pass

    def add_to_stats(self: Any, category: str = "unimplemented") -> None:
        add_stats(self, category)
        try:
            _note_counted(self, category, 1)
        except Exception:  # noqa: BLE001
            pass

    def remove_from_stats(self: Any) -> None:
        category = self.category
        remove_stats(self)
        try:
            _note_counted(self, str(category), -1)
        except Exception:  # noqa: BLE001
            pass

    reasons_fn = cf.get_and_maybe_log_recompilation_reasons
    cfm_init = dguards.CheckFunctionManager.__init__

    def get_and_maybe_log_recompilation_reasons(cache_entries: Any, frame: Any, *args: Any, **kwargs: Any) -> Any:
        reasons = reasons_fn(cache_entries, frame, *args, **kwargs)
        if not kwargs.get("skip_logging", False):
            try:
                _note_recompile(frame.f_code, list(reasons))
            except Exception:  # noqa: BLE001 - capture must never break compilation
                pass
        return reasons

    @functools.wraps(cfm_init)
    def check_function_manager_init(self: Any, *args: Any, **kwargs: Any) -> None:
        cfm_init(self, *args, **kwargs)
        try:
            _note_guards(getattr(self, "guard_manager", None))
        except Exception:  # noqa: BLE001
            pass

    _originals.update(log_graph_break=log_break, add_to_stats=add_stats, remove_from_stats=remove_stats,
                      recompilation_reasons=reasons_fn, cfm_init=cfm_init)
    sc.InstructionTranslatorBase.log_graph_break = log_graph_break  # type: ignore[method-assign]
    dexc.Unsupported.add_to_stats = add_to_stats  # type: ignore[method-assign]
    dexc.Unsupported.remove_from_stats = remove_from_stats  # type: ignore[method-assign]
    cf.get_and_maybe_log_recompilation_reasons = get_and_maybe_log_recompilation_reasons
    dguards.CheckFunctionManager.__init__ = check_function_manager_init  # type: ignore[method-assign]


def _unhook_dynamo() -> None:
    if not _originals:
        return
    from torch._dynamo import convert_frame as cf
    from torch._dynamo import exc as dexc
    from torch._dynamo import guards as dguards
    from torch._dynamo import symbolic_convert as sc

    sc.InstructionTranslatorBase.log_graph_break = _originals["log_graph_break"]  # type: ignore[method-assign]
    dexc.Unsupported.add_to_stats = _originals["add_to_stats"]  # type: ignore[method-assign]
    dexc.Unsupported.remove_from_stats = _originals["remove_from_stats"]  # type: ignore[method-assign]
    cf.get_and_maybe_log_recompilation_reasons = _originals["recompilation_reasons"]
    dguards.CheckFunctionManager.__init__ = _originals["cfm_init"]  # type: ignore[method-assign]
    _originals.clear()


def _recompile_from(code: Any, reasons: list[str]) -> Recompile:
    """A Recompile from the frame's code object and the guard failures Dynamo found (its own text)."""
    failures = [ln.strip() for r in reasons for ln in str(r).splitlines() if ln.strip()]
    fn = str(code.co_name)
    rm = _RESUME.match(fn)
    filename, line = str(code.co_filename), int(code.co_firstlineno)
    detail = "\n".join(f"- {f}" for f in failures)
    return Recompile(
        function=rm.group("fn") + " (resumed after a graph break)" if rm else fn,
        filename=filename,
        line=line,
        location=_location(filename, line),
        failures=failures,
        compile_id=_compile_id(),
        message=f"Recompiling function {fn} in {filename}:{line}\n    triggered by the following guard "
                f"failure(s):\n" + "\n".join("    " + d for d in detail.splitlines()),
    )


def _note_recompile(code: Any, reasons: list[str]) -> None:
    rc = _recompile_from(code, reasons)
    with _lock:
        _recompiles.append(rc)


def _note_guards(guard_manager: Any) -> None:
    cid = _compile_id()
    if cid is None or guard_manager is None:
        return
    text = _readable_guards(str(guard_manager))
    with _lock:
        _guards[cid] = text
    from . import registry

    for r in registry._pending_guards(cid):
        r.guards = list(text)


def _readable_guards(msg: str) -> list[str]:
    """Guard tree lines without the drawing, ambient/global-state guards last."""
    user: list[str] = []
    ambient: list[str] = []
    for ln in msg.splitlines():
        if "+- " not in ln:
            continue
        body = ln.split("+- ", 1)[1].strip()
        if body.endswith("GuardManager") or "GuardManager:" in body and ":" not in body.split("GuardManager:", 1)[1]:
            continue
        (ambient if ("GLOBAL_STATE" in body or "LAMBDA_GUARD: torch._" in body or "TORCH_FUNCTION" in body
                     or "DEFAULT_DEVICE" in body or "GRAD_MODE" in body) else user).append(body)
    return user + ambient


def install() -> None:
    """Start capturing (idempotent). Nothing is printed; records accumulate until :func:`clear`."""
    with _lock:
        if _installed:
            return
        _hook_dynamo()
        _installed["dynamo"] = True


def uninstall() -> None:
    """Stop capturing (Dynamo's functions restored)."""
    with _lock:
        _installed.clear()
        _unhook_dynamo()


def is_installed() -> bool:
    return bool(_installed)


def graph_breaks() -> list[GraphBreak]:
    with _lock:
        return list(_breaks)


def recompiles() -> list[Recompile]:
    with _lock:
        return list(_recompiles)


def guards_for(compile_id: str) -> list[str]:
    """Guard lines Dynamo produced for a compile id (tree-guard text; ambient guards included)."""
    with _lock:
        return list(_guards.get(compile_id, []))


def clear() -> None:
    with _lock:
        _breaks.clear()
        _recompiles.clear()
        _guards.clear()


@dataclass
class DynamoOutput:
    """What Dynamo/Inductor would have printed during a :func:`quiet_dynamo` block."""

    #: ``(logger name, level name, message)`` of every log record of a ``torch.*`` logger
    records: list[tuple[str, str, str]] = field(default_factory=list)
    #: ``warnings.warn`` messages raised from inside ``torch`` (user warnings are shown as usual)
    warnings: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join(m for _, _, m in self.records)


class _Collect(logging.Handler):
    def __init__(self, out: DynamoOutput) -> None:
        super().__init__(level=logging.NOTSET)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            msg = str(record.msg)
        self.out.records.append((record.name, record.levelname, msg))


@contextlib.contextmanager
def quiet_dynamo() -> Iterator[DynamoOutput]:
    """Run a block with Dynamo's and Inductor's printed output captured instead of printed.

    Every ``torch.*`` logger that has handlers (``torch._logging`` gives ``torch._dynamo``,
    ``torch._inductor``... their own stderr handler) and the ``torch`` logger itself send their records
    to the returned :class:`DynamoOutput` for the duration; warnings issued from inside ``torch`` are
    kept there too, other warnings are shown as usual. Everything is restored on exit, on every path.
    Graph-break capture does not depend on this (see :func:`install`).
    """
    out = DynamoOutput()
    handler = _Collect(out)
    saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []
    names = ["torch"] + [n for n in list(logging.Logger.manager.loggerDict) if n.startswith("torch.")]
    for name in names:
        lg = logging.getLogger(name) if name == "torch" else logging.Logger.manager.loggerDict.get(name)
        if not isinstance(lg, logging.Logger) or (name != "torch" and not lg.handlers):
            continue
        saved.append((lg, list(lg.handlers), lg.propagate))
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.addHandler(handler)
        lg.propagate = False
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:  # the user's filters still apply
            yield out
    finally:
        for lg, handlers, propagate in saved:
            lg.removeHandler(handler)
            for h in handlers:
                lg.addHandler(h)
            lg.propagate = propagate
        for w in caught:
            if _from_torch(w.filename):
                out.warnings.append(f"{w.category.__name__}: {w.message}")
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def _from_torch(filename: str) -> bool:
    f = filename.replace("\\", "/")
    return "/torch/" in f or "/functorch/" in f
