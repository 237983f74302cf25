"""The suite's one subprocess helper (tests/_neuron_child.py) turns a crash and a hang into failed tests."""

from __future__ import annotations

import pytest

from tests._neuron_child import run_child, run_child_process


def test_child_facts_and_stderr_are_returned() -> None:
    facts, stderr = run_child_process("""
        import json, sys
        print("noise")
        sys.stderr.write("warned")
        print(json.dumps({"answer": 42}))
    """)
    assert facts == {"answer": 42} and stderr == "warned"


def test_a_crash_is_a_failure_naming_the_signal() -> None:
    with pytest.raises(AssertionError, match=r"child crashed \(SIGSEGV\)"):
        run_child("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")


def test_a_hang_is_a_failure_within_the_timeout() -> None:
    with pytest.raises(AssertionError, match=r"child hung \(no exit within 2 s\)"):
        run_child("import time; time.sleep(60)", timeout=2)


def test_outcomes_prelude_reports_values_and_errors() -> None:
    facts = run_child("""
        emit({"ok": outcome(lambda: torch.arange(3)), "bad": outcome(lambda: torch.ones(2) + torch.ones(3))})
    """, outcomes=True)
    assert facts["ok"] == {"value": [0, 1, 2]}
    assert facts["bad"]["error"] == "RuntimeError"
    assert facts["bad"]["message"].startswith("The size of tensor a (2) must match the size of tensor b (3)")
