"""What an FP8 linear layer is: how its weight's scales are laid out and how its input is
quantized. The one type the quantization config (models/quant_config.py) hands the layers
(layers/fp8_linear.py)."""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT_LAYOUTS = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Fp8Scheme:
    """`weight`: "tensor" (one scale per checkpoint tensor), "channel" (one per output row) or
    "block" (one per `block_size` = (rows, columns) tile). `static_input`: the checkpoint gives
    a per-tensor `input_scale` for the activations; otherwise they are quantized dynamically
    (per token, or per token group of `block_size[1]` columns for block weights)."""

    weight: str
    block_size: tuple[int, int] | None = None
    static_input: bool = False

    def __post_init__(self) -> None:
        if self.weight not in WEIGHT_LAYOUTS:
            raise ValueError(f"FP8 weight layout {self.weight!r}: not one of {WEIGHT_LAYOUTS}")
        if (self.weight == "block") != (self.block_size is not None):
            raise ValueError("FP8 block weights need a block_size, and only they take one")
        if self.block_size is not None:
            if len(self.block_size) != 2 or min(self.block_size) < 1:
                raise ValueError(f"weight_block_size: two positive sizes, got {self.block_size}")
            object.__setattr__(self, "block_size", tuple(int(b) for b in self.block_size))
        if self.static_input and self.weight == "block":
            raise ValueError(
                "activation_scheme: static input scales go with per-tensor or per-channel "
                "weights, not block-scaled ones (their activations are quantized per group)"
            )

    def describe(self) -> str:
        weight = (
            f"{self.block_size[0]}x{self.block_size[1]} blocks"
            if self.block_size
            else (f"per-{self.weight}")
        )
        act = "static per-tensor" if self.static_input else (
            f"dynamic per-{self.block_size[1]}-column group" if self.block_size else
            "dynamic per-token"
        )  # fmt: skip
        return f"FP8 weights {weight}, {act} activations"
