"""The suite's own guard (tests/conftest.py): a test that leaves a process running fails, the
process is killed, and a test that cleans up passes. Run as an inner pytest session."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]

INNER = """
import subprocess, sys

def test_leaks():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{marker}"])

def test_cleans_up():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proc.kill()
    proc.wait()
"""


def test_a_process_outliving_its_test_fails_it_and_is_killed(tmp_path):
    marker = f"leak-{uuid.uuid4().hex}"
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import (_no_process_outlives_its_module,\n"
        "    _no_process_outlives_its_test, _no_process_outlives_the_session)\n"
    )
    (tmp_path / "test_inner.py").write_text(INNER.format(marker=marker))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
         str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "2 passed, 1 error" in out, out
    assert "ERROR at teardown of test_leaks" in out
    assert "1 process(es) started by test test_inner.py::test_leaks outlived it (killed now)" in out
    left = [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
    assert left == []
