"""Every `ATOM_*` environment variable the kernels read, defined once: its name, its default and
what it does (docs/configuration.md lists them all). Each is read when asked (`VAR.value()`), so
a test can set it with monkeypatch; modules that read one at import say so in its doc.

The runtime has its own list (atom_runtime/envs.py) built on the same `EnvVar`."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    doc: str
    choices: tuple[str, ...] = ()  # when set, any other value raises naming the variable

    def value(self) -> str:
        """The variable's value (stripped; its default when unset or empty)."""
        raw = os.environ.get(self.name, "").strip()
        value = raw or self.default
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.name}={raw!r}: expected one of {', '.join(self.choices)}")
        return value

    def enabled(self) -> bool:
        """For 0/1 switches: True unless the value is "0" (or the default is "0" and unset)."""
        return self.value() != "0"

    def number(self) -> float:
        value = self.value()
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{self.name}={value!r}: expected a number") from None


KERNEL_BACKEND = EnvVar(
    "ATOM_KERNEL_BACKEND",
    "",
    "Force every op onto one backend: `torch` (the references) or `triton` (Triton kernels, the "
    "interpreter on CPU with TRITON_INTERPRET=1). Unset: Triton on a GPU, torch on CPU.",
)
PDL = EnvVar(
    "ATOM_PDL",
    "1",
    "0 turns off programmatic dependent launch (Hopper and newer NVIDIA GPUs), where a kernel "
    "starts loading weights before the kernel ahead of it has finished.",
    ("0", "1"),
)
DECODE_PACK_HEADS = EnvVar(
    "ATOM_DECODE_PACK_HEADS",
    "1",
    "0: one KV head per decode-attention program even at large batch (the engine otherwise "
    "packs two KV heads a program where the launch keeps every multiprocessor busy). Read at "
    "import.",
    ("0", "1"),
)
GEMV_EARLY = EnvVar(
    "ATOM_GEMV_EARLY",
    "",
    "Columns a batch-1 GEMV program loads before waiting on the kernel before it (PDL); unset: "
    "1,024 where kernels launch with PDL, one step elsewhere.",
)
GDN_PREFILL = EnvVar(
    "ATOM_GDN_PREFILL",
    "triton",
    "Gated DeltaNet prefill kernel: `triton` (ours) or `fla` (fla-core's chunked kernels, for "
    "very long single prompts). Read at import.",
    ("triton", "fla"),
)
GDN_DECODE = EnvVar(
    "ATOM_GDN_DECODE",
    "auto",
    "Fused Gated DeltaNet decode kernel: `auto` (the wide kernel where a batch fills the GPU, "
    "its launch timed at start-up), `split` (the small-batch kernel at every batch: the path "
    "before the wide one, for comparisons) or `wide` (the wide kernel at every batch). Read at "
    "import.",
    ("auto", "split", "wide"),
)
MOE_GEMV = EnvVar(
    "ATOM_MOE_GEMV",
    "1",
    "0 turns off the MoE pair GEMV for steps of few tokens (the grouped GEMM runs instead). "
    "Read at import.",
    ("0", "1"),
)
MOE_GEMV_MAX_TOKENS = EnvVar(
    "ATOM_MOE_GEMV_MAX_TOKENS",
    "1",
    "The most tokens in a step for which MoE layers take the pair GEMV. Read at import.",
)

VARIABLES = (KERNEL_BACKEND, PDL, DECODE_PACK_HEADS, GEMV_EARLY, GDN_PREFILL, GDN_DECODE,
             MOE_GEMV, MOE_GEMV_MAX_TOKENS)  # fmt: skip
