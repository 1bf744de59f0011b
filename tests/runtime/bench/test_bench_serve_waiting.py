"""`atom bench serve` against no server: it says it is waiting, and gives up after the stated
time (--ready-check-timeout-sec), in one line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

ATOM = Path(sys.executable).parent / "atom"


def test_bench_serve_says_it_waits_and_gives_up_after_the_stated_time():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [str(ATOM), "bench", "serve", "--port", str(port), "--ready-check-timeout-sec", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith(f"waiting for the server at http://127.0.0.1:{port} (0 s;")
    assert "giving up after 2 s, --ready-check-timeout-sec" in lines[0]
    assert lines[-1].startswith(f"atom bench serve: error: cannot reach http://127.0.0.1:{port}")
    assert "Traceback" not in proc.stderr
