"""benchmarks/run.py, the benchmark suite's runner, on CPU: every suite's commands name paths that
exist and flags their command's `--help` knows (the pending suites lack only their own issue's
flags), a command with an unknown flag is refused before anything runs, and a run records each
command's exit status and JSON, starts and stops a server around its clients and stops a command
at its time limit."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def runner():
    sys.path.insert(0, str(BENCH))  # run.py imports its suites as a sibling module
    try:
        spec = importlib.util.spec_from_file_location("benchmark_run", BENCH / "run.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def run_steps(runner, out: Path, suite) -> list[dict]:
    """Run a suite's steps as run.py does; the entries results.json holds for it."""
    run = runner.Run(out, tail=5)
    try:
        for step in suite.steps:
            run.step(suite, step, runner.free_port())
    finally:
        run.close()
    return json.loads((out / "results.json").read_text())["suites"][suite.name]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "run.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_list_names_at_most_fifteen_suites_and_marks_the_pending(runner):
    done = run_cli("--list")
    assert done.returncode == 0, done.stderr
    names = [line.split()[0] for line in done.stdout.splitlines()]
    assert names == [s.name for s in runner.SUITES]
    assert len(names) <= 15
    for suite in runner.SUITES:
        line = next(x for x in done.stdout.splitlines() if x.split()[0] == suite.name)
        assert ("pending" in line) == bool(suite.pending)


def test_dry_run_prints_every_command_with_placeholders_filled(tmp_path):
    done = run_cli("--dry-run", "--out", str(tmp_path), "all")
    assert done.returncode == 0, done.stderr
    assert "$" not in done.stdout.replace("$json", "")  # no unfilled placeholder
    assert "atom bench latency --load-format dummy --model benchmarks/configs/qwen3-0.6b" in (
        done.stdout
    )
    assert f"{tmp_path}/json/w2_qwen3-0.6b.json" in done.stdout
    assert not (tmp_path / "json").exists()  # a dry run writes nothing


def test_unknown_suite_is_refused_by_name():
    done = run_cli("w9")
    assert done.returncode != 0
    assert "unknown suite w9" in done.stderr


@pytest.mark.slow
def test_every_suite_names_existing_paths_and_known_flags(runner, tmp_path):
    found = runner.problems(list(runner.SUITES), runner.environment(tmp_path))
    for suite in runner.SUITES:
        if not suite.pending:
            assert found[suite.name] == [], suite.name
            continue
        # A pending suite may lack only the flags its issue is building.
        for problem in found[suite.name]:
            flag = problem.rsplit(" ", 1)[-1]
            assert "has no flag" in problem and flag in suite.pending, problem


def test_a_command_with_an_unknown_flag_or_path_is_refused(runner, tmp_path):
    bad = runner.Suite(
        "bad",
        "",
        (
            runner.Step("atom bench prefix --admission-only --no-such-flag 1"),
            runner.Step("python benchmarks/no_such_script.py --out $json/x.json"),
        ),
    )
    found = runner.problems([bad], runner.environment(tmp_path))
    assert "`atom bench prefix` has no flag --no-such-flag" in found["bad"]
    assert any("no such path benchmarks/no_such_script.py" in p for p in found["bad"])
    assert not runner.report_problems(found, [bad], running=True)


def test_a_pending_suite_without_its_flags_fails_before_running(runner, tmp_path):
    pending = [s for s in runner.SUITES if s.pending]
    found = runner.problems(pending, runner.environment(tmp_path))
    if not any(found.values()):
        pytest.skip("the pending suites' flags exist in this checkout: nothing left pending")
    name = next(n for n, p in found.items() if p)
    done = run_cli("--out", str(tmp_path), name)
    assert done.returncode == 2
    assert "has no flag" in done.stderr and "nothing was run" in done.stderr
    assert not (tmp_path / "results.json").exists()


def test_a_run_records_exit_status_and_folds_the_json_written(runner, tmp_path):
    suite = runner.Suite(
        "cpu",
        "",
        (
            runner.Step("atom bench prefix --admission-only --output-json $json/admission.json"),
            runner.Step("python -c 'import sys; sys.exit(3)'"),
        ),
    )
    entries = run_steps(runner, tmp_path, suite)
    assert [e["rc"] for e in entries] == [0, 3]
    assert "admission" in entries[0]["results"]
    assert entries[0]["command"].startswith("atom bench prefix --admission-only")
    assert not (tmp_path / "json").exists()  # every JSON folded into results.json
    assert "== cpu: atom bench prefix" in (tmp_path / "run.log").read_text()
    # A second run into the same folder appends its entries.
    again = runner.Suite("cpu", "", suite.steps[1:])
    assert [e["rc"] for e in run_steps(runner, tmp_path, again)] == [0, 3, 3]


def test_a_server_runs_for_its_clients_and_is_stopped_after_them(runner, tmp_path):
    client = (
        "python -c 'import time, urllib.request as u\n"
        "for _ in range(600):\n"
        "    try:\n"
        '        print("status", u.urlopen("http://127.0.0.1:$port/").status); break\n'
        "    except OSError: time.sleep(0.1)\n"
        "'"
    )
    server = runner.Step(
        "python -m http.server $port --bind 127.0.0.1", clients=(runner.Step(client),)
    )
    entries = run_steps(runner, tmp_path, runner.Suite("srv", "", (server,)))
    assert [e["rc"] for e in entries] == [0, 0]  # the client, then the server stopped by us
    log = (tmp_path / "run.log").read_text()
    assert "status 200" in log
    assert "[server] 127.0.0.1 - - " in log and '"GET / HTTP/1.1" 200' in log


def test_a_command_past_its_limit_is_stopped_and_recorded(runner, tmp_path):
    slow = runner.Step("python -c 'import time; time.sleep(600)'", timeout_s=1)
    entries = run_steps(runner, tmp_path, runner.Suite("slow", "", (slow,)))
    assert entries[0]["rc"] == 124
    assert entries[0]["seconds"] < 120
