"""Ctrl-C that cannot leave the lab half set up.

:class:`SigintGate` defers SIGINT while the lab sets up or tears down its state around a user's cell
(recorder, allocator history, Dynamo capture), and lets it through while the user's own code runs:

    gate = SigintGate()
    with gate:                      # SIGINT here is remembered, not raised
        setup()
        with gate.open():           # the user's code: Ctrl-C interrupts it as usual
            run_user_code()
        teardown()
    if gate.pending: ...            # an interrupt arrived during set-up/tear-down

A SIGINT remembered during set-up is raised as ``KeyboardInterrupt`` as soon as the user's code would
start (so the cell does not run), one during tear-down is reported through ``pending`` after the lab's
state is restored. Outside the main thread (where Python delivers no signals) the gate does nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["SigintGate"]


class SigintGate:
    def __init__(self) -> None:
        self.pending = False
        self._saved: Any = None
        self._active = False

    def _defer(self, signum: int, frame: Any) -> None:
        self.pending = True

    def __enter__(self) -> SigintGate:
        if threading.current_thread() is threading.main_thread():
            self._saved = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._defer)
            self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._active:
            signal.signal(signal.SIGINT, self._saved)
            self._active = False

    @contextmanager
    def open(self) -> Iterator[None]:
        """Let SIGINT through (the handler that was installed before the gate) for the block."""
        __tracebackhide__ = True  # noqa: F841
        if not self._active:
            yield
            return
        signal.signal(signal.SIGINT, self._saved)
        try:
            if self.pending:
                self.pending = False
                raise KeyboardInterrupt
            yield
        finally:
            signal.signal(signal.SIGINT, self._defer)
