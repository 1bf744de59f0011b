"""The API server process: FastAPI on uvicorn in front of an EngineCore process.

Lifecycle, in order:
1. `serve` titles the process, binds the port (a busy port fails at once) and starts uvicorn;
   `/health` answers 503 while the engine core loads in the background.
2. The engine core says Ready; the tokenizer loads; the GC policy is applied; `/health` is 200.
3. SIGTERM/SIGINT: uvicorn stops accepting, in-flight requests get `--shutdown-grace-period`
   seconds to finish; those still running then are cut cleanly (a 503 with an error body, or a
   final SSE error event and `[DONE]`; aborted in the engine; one log line says how many), the
   engine core is stopped, the GC unfrozen, and the process exits 0.
4. If the engine core dies: in-flight requests fail with 503, `/health` turns 503, and the server
   exits 1 after $ATOM_ENGINE_DEATH_EXIT_DELAY_S (default 1 s: long enough for a probe to see
   the 503; a test raises it to look at the 503 at leisure).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Coroutine
from typing import Any

import uvicorn

from atom_runtime.config import EngineConfig
from atom_runtime.server.app import build_app
from atom_runtime.server.state import ServerConfig, ServerState
from atom_runtime.system.process import set_process_title
from atom_runtime.web.listen import listening_socket, uvicorn_config

log = logging.getLogger("atom_runtime.server")

# After the grace period's cut, how long the cut responses get to be written out before uvicorn
# cancels what is left (a last resort: the cut ends every request the server knows of).
CUT_DRAIN_S = 10.0


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run the server on uvloop when it is installed, else on asyncio's own loop. uvloop's
    socket writes and task wake-ups cost less, and they are most of a stream's work here
    (docs/serving.md, "The output path")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def serve(config: ServerConfig, engine_config: EngineConfig) -> int:
    """Run `atom serve` until SIGTERM/SIGINT or engine death; returns the exit code."""
    set_process_title("APIServer")
    try:
        sock = listening_socket(config.host, config.port)
    except OSError as e:
        log.error("atom serve: cannot listen on %s:%d: %s", config.host, config.port, e)
        return 2
    state = ServerState(config, engine_config)
    app = build_app(state)
    server = _Server(
        uvicorn_config(
            app,
            config.uvicorn_log_level,
            timeout_graceful_shutdown=config.shutdown_grace_period + CUT_DRAIN_S,
        ),
        state,
    )
    state.server = server
    # uvicorn re-raises the signal that stopped it once it is done; catch it here so a SIGTERM
    # ends in a clean exit code instead of the default action.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _note_signal)
    await server.serve(sockets=[sock])
    return state.exit_code


class _Server(uvicorn.Server):
    """uvicorn whose graceful shutdown ends with a clean cut: when the grace period is over, the
    requests still running are answered (503, or an SSE error event and [DONE]) instead of
    being cancelled mid-write by uvicorn, which would leave clients a truncated stream and the
    log a CancelledError traceback."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = self.state.config.shutdown_grace_period
        timer = asyncio.get_running_loop().call_later(grace, self.state.cut_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def _note_signal(signum: int, frame: object) -> None:
    log.info("%s handled; exiting", signal.Signals(signum).name)
