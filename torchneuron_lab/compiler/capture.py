"""Ambient capture of Dynamo's graph breaks, recompiles and guards.

Dynamo reports these through its logging artifacts (``graph_breaks``, ``recompiles``, ``guards``); while
capture is installed, those loggers feed structured records here instead of printing. Each record
carries Dynamo's own reason/explanation/hint text, the user location, and the compile id.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "GraphBreak",
    "Recompile",
    "clear",
    "graph_breaks",
    "guards_for",
    "install",
    "is_installed",
    "recompiles",
    "set_location_mapper",
    "uninstall",
]

_BREAK_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
_RECOMPILE_LOGGER = "torch._dynamo.guards.__recompiles"
_GUARDS_LOGGER = "torch._dynamo.guards.__guards"


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
_installed: dict[str, tuple[int, bool]] = {}
_mapper: Callable[[str, int], str | None] | None = None

_AT = re.compile(r"in user code at (?P<file>.+?):(?P<line>\d+)")
_RECOMP = re.compile(r"Recompiling function (?P<fn>\S+) in (?P<file>.+?):(?P<line>\d+)")
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


def _parse_break(msg: str) -> GraphBreak | None:
    m = _AT.search(msg)
    if m is None:
        return None
    lines = msg.splitlines()
    reason = ""
    explanation = ""
    hints: list[str] = []
    for i, ln in enumerate(lines):
        s = ln.strip()
        if s.startswith("Graph Break Reason:"):
            reason = s[len("Graph Break Reason:"):].strip()
            # the reason may continue on the next non-empty line ("...: a function call, e.g. f(x, y):")
            if reason.endswith(":") and i + 2 < len(lines):
                nxt = next((x.strip() for x in lines[i + 1:] if x.strip()), "")
                if nxt and not nxt.startswith(("Explanation:", "Hint:")):
                    reason = f"{reason} {nxt}"
        elif s.startswith("Explanation:"):
            explanation = s[len("Explanation:"):].strip()
        elif s.startswith("Hint:"):
            hints.append(s[len("Hint:"):].strip())
    filename, line = m.group("file"), int(m.group("line"))
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', msg)
    here = [f for f in frames if (f[0], int(f[1])) == (filename, line)]
    function = (here or frames or [(None, None, None)])[-1][2]
    if function:
        rm = _RESUME.match(function)
        if rm:
            function = rm.group("fn")
    return GraphBreak(
        reason=reason or lines[0],
        filename=filename,
        line=line,
        location=_location(filename, line),
        explanation=explanation,
        hints=hints,
        compile_id=_compile_id(),
        function=function,
        message=msg,
    )


def _parse_recompile(msg: str) -> Recompile | None:
    m = _RECOMP.search(msg)
    if m is None:
        return None
    failures = [ln.strip()[2:].strip() for ln in msg.splitlines() if ln.strip().startswith("- ")]
    fn = m.group("fn")
    rm = _RESUME.match(fn)
    filename, line = m.group("file"), int(m.group("line"))
    return Recompile(
        function=rm.group("fn") + " (resumed after a graph break)" if rm else fn,
        filename=filename,
        line=line,
        location=_location(filename, line),
        failures=failures,
        compile_id=_compile_id(),
        message=msg,
    )


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


class _Handler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken log record must never break compilation
            return
        try:
            if record.name == _BREAK_LOGGER:
                gb = _parse_break(msg)
                if gb is not None:
                    with _lock:
                        for prev in _breaks:
                            if (prev.filename, prev.line, prev.reason) == (gb.filename, gb.line, gb.reason):
                                prev.count += 1
                                break
                        else:
                            _breaks.append(gb)
            elif record.name == _RECOMPILE_LOGGER:
                rc = _parse_recompile(msg)
                if rc is not None:
                    with _lock:
                        _recompiles.append(rc)
            elif record.name == _GUARDS_LOGGER:
                cid = _compile_id()
                if cid is not None and "TREE_GUARD_MANAGER" in msg:
                    text = _readable_guards(msg)
                    with _lock:
                        _guards[cid] = text
                    from . import registry

                    for r in registry._pending_guards(cid):
                        r.guards = list(text)
        except Exception:  # noqa: BLE001
            return


_handler = _Handler(level=logging.DEBUG)


def install() -> None:
    """Start capturing (idempotent). Nothing is printed; records accumulate until :func:`clear`."""
    with _lock:
        if _installed:
            return
        # Dynamo formats recompile reasons only when the artifact is enabled in torch._logging's state.
        try:
            import torch._logging._internal as _tl

            _tl.log_state.enable_artifact("recompiles")
        except Exception:  # noqa: BLE001 - an older/newer torch without this state: breaks still work
            pass
        for name in (_BREAK_LOGGER, _RECOMPILE_LOGGER, _GUARDS_LOGGER):
            lg = logging.getLogger(name)
            _installed[name] = (lg.level, lg.propagate)
            lg.setLevel(logging.DEBUG)
            lg.propagate = False
            lg.addHandler(_handler)


def uninstall() -> None:
    """Stop capturing and restore the loggers as they were."""
    with _lock:
        for name, (level, propagate) in _installed.items():
            lg = logging.getLogger(name)
            lg.removeHandler(_handler)
            lg.setLevel(level)
            lg.propagate = propagate
        _installed.clear()


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
