"""KV transfer between engines for prefill/decode disaggregation (docs/disaggregation.md).

config.py (--kv-transfer-config), auth.py (the deployment's transfer key: router-signed params,
sealed wire messages; every connector's), base.py (the connector seam, the KV cache as bytes),
tcp.py with wire.py, producer.py, consumer.py and payload.py (the portable transport), agent.py
(holds and pulls in the engine).
"""

from __future__ import annotations


def make_transfer_agent(config, block_manager, runner, hybrid: bool = False, windowed=False):
    """The engine's TransferAgent for `config.kv_transfer_config`, or None without one.
    `hybrid`: the model keeps per-request recurrent state, which a transfer does not carry yet.
    `windowed`: its sliding-window layers keep blocks of their own (KV groups), which a transfer
    does not carry yet either."""
    from atom_runtime.kv_transfer.config import KVTransferConfig

    parsed = KVTransferConfig.from_cli(config.kv_transfer_config)
    if parsed is None:
        return None
    if config.tensor_parallel_size != 1:
        raise ValueError(
            "kv_transfer_config: the portable connector moves one engine's whole KV cache and "
            "needs tensor_parallel_size 1 (each tensor-parallel rank holds a shard)"
        )
    if hybrid:
        raise ValueError(
            "kv_transfer_config: this model keeps per-request recurrent state (a hybrid model) "
            "and a KV transfer carries attention blocks only; serve it aggregated (without "
            "--kv-transfer-config) until the state image travels too"
        )
    if windowed:
        raise ValueError(
            "kv_transfer_config: this model's sliding-window layers keep KV blocks of their own "
            "(docs/kv-groups.md) and a KV transfer carries one block table; serve it "
            "aggregated (without --kv-transfer-config)"
        )
    from atom_runtime.kv_transfer.agent import TransferAgent
    from atom_runtime.kv_transfer.base import KVCacheAccess

    return TransferAgent(parsed, block_manager, KVCacheAccess(runner.model.attention_layers()))
