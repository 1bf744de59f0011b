"""Start-up phases: recorded, logged, summed (system/startup.py)."""

from __future__ import annotations

import logging

import pytest

from atom_runtime.system.startup import PHASES, StartupPhases


def test_phases_add_up_and_log_one_line_each(caplog):
    phases = StartupPhases()
    with caplog.at_level(logging.INFO, logger="atom_runtime.startup"):
        phases.add("config", 0.5)
        phases.add("kernel_autotune", 1.0, "batch-1 kernel timings")
        phases.add("kernel_autotune", 0.25, "compiles")
        phases.add("warm_up", 0.01)  # too short to log, still recorded
    assert phases.seconds == {"config": 0.5, "kernel_autotune": 1.25, "warm_up": 0.01}
    assert [r.getMessage() for r in caplog.records] == [
        "start-up: config 0.50 s",
        "start-up: kernel autotune 1.00 s (batch-1 kernel timings)",
        "start-up: kernel autotune 0.25 s (compiles)",
    ]
    assert phases.summary() == "1.8 s: config 0.50, kernel autotune 1.25, warm up 0.01"


def test_an_unknown_phase_is_refused_and_quiet_recorders_do_not_log(caplog):
    with pytest.raises(ValueError, match="unknown start-up phase 'loading'"):
        StartupPhases().add("loading", 1.0)
    quiet = StartupPhases(quiet=True)
    with caplog.at_level(logging.INFO, logger="atom_runtime.startup"):
        with quiet.phase("graph_capture"):
            pass
    assert "graph_capture" in quiet.seconds and not caplog.records
    assert PHASES[0] == "config" and PHASES[-1] == "ready"


def test_the_ready_clock_starts_with_the_process():
    import time

    from atom_runtime.system.startup import process_started_at

    age = time.time() - process_started_at()
    assert 0 < age < 24 * 3600  # this test process started before the test, today
