"""Every `ATOM_*` environment variable of the runtime, defined once: its name, its default and
what it does (docs/configuration.md lists them, with the kernels' own in atom_kernels/envs.py).
Settings a user types belong in flags (config.py); these are for what a flag cannot carry: the
host (CPU cache size), test and debugging knobs, and secrets kept out of `ps`.

Each is read when asked (`VAR.value()`), so a test can set it with monkeypatch."""

from __future__ import annotations

from atom_kernels.envs import EnvVar

API_KEY = EnvVar(
    "ATOM_API_KEY",
    "",
    "The API key `atom serve` requires (vLLM's VLLM_API_KEY): the default of --api-key, so the "
    "key stays out of the process list.",
)
CPU_KVCACHE_SPACE = EnvVar(
    "ATOM_CPU_KVCACHE_SPACE",
    "2",
    "GiB of host memory for the KV cache (and hybrid state) on CPU (vLLM's "
    "VLLM_CPU_KVCACHE_SPACE).",
)
DENSE_PREFILL = EnvVar(
    "ATOM_DENSE_PREFILL",
    "",
    "Fresh prompts attend densely (cuDNN / flash attention) on a CUDA GPU: unset = for wide "
    "query heads only, 1 = for narrow heads too, 0 = never (the paged kernel for every prefill).",
    ("", "0", "1"),
)
SMALL_M_KERNELS = EnvVar(
    "ATOM_SMALL_M_KERNELS",
    "auto",
    "Batch-1 kernel choice per layer group: auto (timed at start-up), checked (timed, then "
    "checked on a whole batch-1 step), cublas, or gemv (the Triton GEMV on its most fused path).",
    ("auto", "checked", "cublas", "gemv"),
)
STATE_CHECKPOINT_DEMAND = EnvVar(
    "ATOM_STATE_CHECKPOINT_DEMAND",
    "",
    "Demand checkpoints of hybrid models on or off when --state-checkpoint-demand is not given "
    "(1/0, true/false, yes/no, on/off; unset: on).",
)
TP_TIMEOUT_S = EnvVar(
    "ATOM_TP_TIMEOUT_S",
    "300",
    "Seconds a tensor-parallel collective may wait before it raises (a stuck peer).",
)
GC_FREEZE = EnvVar(
    "ATOM_GC_FREEZE",
    "1",
    "0: tuned GC thresholds instead of gc.freeze() after warm-up (contract 7).",
    ("0", "1"),
)
GC_DEBUG = EnvVar(
    "ATOM_GC_DEBUG",
    "0",
    "1: log every garbage collection with its generation, duration and reclaimed count.",
    ("0", "1"),
)
ENGINE_DEATH_EXIT_DELAY_S = EnvVar(
    "ATOM_ENGINE_DEATH_EXIT_DELAY_S",
    "1",
    "Seconds the API server keeps answering 503 after its engine core died, before it exits 1.",
)
TRANSFER_KEY_FILE = EnvVar(
    "ATOM_TRANSFER_KEY_FILE",
    "",
    "A file holding the deployment's KV-transfer key (64 hex digits): engines with "
    "--kv-transfer-config and `atom router` sign and check transfers with it "
    "(docs/security.md). The operator mounts it at /etc/atom/keys/transfer-key.",
)
TRANSFER_KEY = EnvVar(
    "ATOM_TRANSFER_KEY",
    "",
    "The KV-transfer key itself (64 hex digits), when no ATOM_TRANSFER_KEY_FILE is given.",
)
ROUTER_API_KEY = EnvVar(
    "ATOM_ROUTER_API_KEY",
    "",
    "The API key `atom router` requires on every route but /health: the default of its "
    "--api-key, so the key stays out of the process list.",
)
KV_EVENTS_PREFIX = "ATOM_KV_EVENTS_"  # ATOM_KV_EVENTS_<FIELD>: a --kv-events-config field

VARIABLES = (API_KEY, CPU_KVCACHE_SPACE, DENSE_PREFILL, SMALL_M_KERNELS,
             STATE_CHECKPOINT_DEMAND, TP_TIMEOUT_S, GC_FREEZE, GC_DEBUG,
             ENGINE_DEATH_EXIT_DELAY_S, TRANSFER_KEY_FILE, TRANSFER_KEY,
             ROUTER_API_KEY)  # fmt: skip
