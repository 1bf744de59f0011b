"""What every route of the API server reads: its settings (`ServerConfig`) and `ServerState`, the
engine client plus the serving layer once the engine is ready, and the engine's warm-up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from atom_runtime import envs
from atom_runtime.config import EngineConfig
from atom_runtime.engine.core_client import EngineCoreClient, EngineStartupError
from atom_runtime.engine.output_processor import OutputProcessor
from atom_runtime.protocol.engine_core import EngineReady
from atom_runtime.server.metrics import ServerMetrics
from atom_runtime.server.serving import OpenAIServing
from atom_runtime.server.stats_log import log_stats_while_busy
from atom_runtime.system import startup
from atom_runtime.system.process import apply_gc_policy
from atom_runtime.text.tokenizer import Tokenizer
from atom_runtime.web.errors import engine_unavailable

log = logging.getLogger("atom_runtime.server")

LOADING_LOG_S = 5.0  # how often "loading (N s)" is logged until the engine is ready


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    log_requests: bool = True
    shutdown_grace_period: float = 10.0
    engine_stall_timeout: float = 300.0
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice: tool_choice "auto"
    reasoning_parser: str | None = None  # --reasoning-parser: reasoning_content in chat answers
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_sequences_per_request: int = 256
    enable_debug_endpoints: bool = False  # /debug/kv_cache and POST /reset_prefix_cache
    uvicorn_log_level: str = "info"
    log_stats: bool = True  # a stats line every STATS_LOG_S while the engine is busy
    chat_template: str | None = None  # replaces the model's (--chat-template)
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty: no CORS headers
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    started: float | None = None  # time.time() when the command started (for the ready phase)


class ServerState:
    """Everything the routes read: the engine client, and the serving layer once ready."""

    def __init__(self, config: ServerConfig, engine_config: EngineConfig) -> None:
        self.config = config
        self.engine_config = engine_config
        self.client = EngineCoreClient(engine_config, config.log_level, config.engine_stall_timeout)
        self.metrics = ServerMetrics(lambda: self.client.stats)
        self.serving: OpenAIServing | None = None
        self.server: uvicorn.Server | None = None
        self.exit_code = 0
        self.started = config.started or time.time()
        self.model_names = [config.served_model_name or engine_config.served_model_name or
                            engine_config.model or _default_model_name()]  # fmt: skip
        self._stats: asyncio.Future | None = None

    @property
    def healthy(self) -> bool:
        return self.serving is not None and not self.client.dead and not self._stopping

    @property
    def _stopping(self) -> bool:
        return self.server is not None and self.server.should_exit

    def require_serving(self) -> OpenAIServing:
        if self.client.dead:
            raise engine_unavailable("the engine core died; the server is exiting")
        if self.serving is None:
            raise engine_unavailable("the model is still loading")
        return self.serving

    def exit(self, code: int) -> None:
        self.exit_code = code
        if self.server is not None:
            self.server.should_exit = True

    async def start_engine(self) -> None:
        """Warm-up: load the engine core and the tokenizer (saying "loading (N s)" meanwhile),
        then apply the GC policy; the ready lines come last, after uvicorn's own."""
        progress = asyncio.ensure_future(self._log_loading())
        try:
            ready = await self.client.start()
            with startup.recorder().phase("tokenizer"):
                tokenizer = await asyncio.to_thread(self._load_tokenizer, ready)
        except (EngineStartupError, OSError, ValueError) as e:
            # The error is the last line: uvicorn's shutdown chatter below it would bury it.
            logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
            log.error("atom serve: the engine failed to start: %s", e)
            self.exit(1)
            return
        finally:
            progress.cancel()
        self.client.attach_processor(OutputProcessor(tokenizer))
        self.client.on_death = self.on_engine_death
        self.serving = OpenAIServing(
            self.client,
            tokenizer,
            self.model_names,
            self.metrics,
            self.config.log_requests,
            self.config.tool_call_parser,
            self.config.max_sequences_per_request,
            self.config.reasoning_parser,
        )
        apply_gc_policy()
        await self._announce_ready(ready)

    def _load_tokenizer(self, ready: EngineReady) -> Tokenizer:
        from atom_runtime.models.source import resolve_model_path

        ec = self.engine_config
        path = Path(ready.model_path)
        if ec.tokenizer is not None:
            path = resolve_model_path(ec.tokenizer, ec.revision, ec.download_dir)
        tokenizer = Tokenizer.from_path(path, ready.eos_token_ids)
        if self.config.chat_template is not None:
            tokenizer.set_chat_template(self.config.chat_template)
        return tokenizer

    async def _log_loading(self) -> None:
        """ "loading (N s)" every LOADING_LOG_S until the engine is ready (or failed)."""
        while True:
            await asyncio.sleep(LOADING_LOG_S)
            log.info("loading %s (%.0f s)", self.model_names[0], time.time() - self.started)

    async def _announce_ready(self, ready: EngineReady) -> None:
        # uvicorn logs "Application startup complete" and "Uvicorn running on ..." once it is
        # listening; ours must come after them (the engine takes far longer than uvicorn).
        while self.server is not None and not self.server.started and not self._stopping:
            await asyncio.sleep(0.05)
        phases = startup.recorder()
        phases.seconds.update({k: v for k, v in ready.startup_seconds.items() if k != "ready"})
        phases.add("ready", time.time() - self.started, quiet=True)
        self.metrics.record_startup(phases.seconds)
        log.info("start-up: %s", phases.summary())
        if self.config.log_stats:
            self._stats = asyncio.ensure_future(log_stats_while_busy(self.client))
        c = self.config
        log.info(
            "serving %s (%s) on %s: %d KV blocks of %d tokens, max_model_len %d, "
            "up to %d tokens a step",
            self.model_names[0],
            ready.model_path,
            ready.device,
            ready.num_blocks,
            ready.block_size,
            ready.max_model_len,
            ready.max_num_batched_tokens,
        )
        log.info(
            "ready in %.1f s: OpenAI-compatible API at http://%s:%d/v1",
            time.time() - self.started,
            c.host,
            c.port,
        )

    async def stop_background(self) -> None:
        """Stop the stats line (at shutdown)."""
        if self._stats is not None:
            self._stats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats

    def cut_in_flight(self) -> None:
        """The shutdown grace period is over: end the requests still running, cleanly."""
        if self.serving is None:
            return
        grace = self.config.shutdown_grace_period
        cut = self.serving.cut_in_flight(
            f"the server is shutting down and the request did not finish within the "
            f"{grace:g} s shutdown grace period"
        )
        if cut:
            log.warning(
                "shutdown grace period (%g s) over: %d request(s) still running were cut off "
                "(503 / SSE error event)",
                grace,
                cut,
            )

    def on_engine_death(self) -> None:
        self.exit_code = 1
        delay = envs.ENGINE_DEATH_EXIT_DELAY_S.number()
        asyncio.get_running_loop().call_later(delay, self.exit, 1)


def _default_model_name() -> str:
    from atom_runtime.models.source import DEFAULT_MODEL

    return DEFAULT_MODEL
