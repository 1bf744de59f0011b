"""KV transfer between engines for prefill/decode disaggregation (docs/disaggregation.md).

config.py (--kv-transfer-config), auth.py (the deployment's transfer key: router-signed params,
sealed wire messages; every connector's), base.py (the connector seam, the KV cache as bytes),
agent.py and agent_holds.py (holds and pulls in the engine), state_handoff.py (a hybrid model's
state as a checkpoint that travels), shards.py (which producer rank holds which heads),
fanout.py and ranks.py (one transport a tensor-parallel rank, driven from rank 0), holds.py
(what every producer keeps and checks); the transports: tcp.py with wire.py, producer.py,
consumer.py and payload.py (portable), nixl.py with nixl_*.py (NIXL).
"""

from __future__ import annotations


def make_transfer_agent(config, block_manager, executor, model_config, checkpoints=None):
    """The engine's TransferAgent for `config.kv_transfer_config`, or None without one: a
    transport on every tensor-parallel rank (rank 0's here, the others' started in their worker
    processes), driven through one ShardedConnector. `checkpoints`: a hybrid model's state
    checkpoints, which its state travels as (required for a hybrid model)."""
    from atom_runtime.kv_transfer.config import KVTransferConfig

    parsed = KVTransferConfig.from_cli(config.kv_transfer_config)
    if parsed is None:
        return None
    tp = config.tensor_parallel_size
    if parsed.kv_port + tp - 1 > 65535:
        raise ValueError(
            f"kv_transfer_config.kv_port: rank r listens on kv_port + r; {parsed.kv_port} + "
            f"{tp - 1} is not a port"
        )
    if model_config.is_hybrid and checkpoints is None:
        raise ValueError(
            "kv_transfer_config: a hybrid model's recurrent state travels as a state checkpoint; "
            "keep prefix caching on and --state-checkpoint-interval-tokens other than 0"
        )
    if getattr(model_config, "kv_window", None) is not None:
        raise ValueError(
            "kv_transfer_config: this model's sliding-window layers keep KV blocks of their own "
            "(docs/kv-groups.md) and a KV transfer carries one block table; serve it "
            "aggregated (without --kv-transfer-config)"
        )
    from atom_runtime.kv_transfer.agent import TransferAgent
    from atom_runtime.kv_transfer.base import Wakeup
    from atom_runtime.kv_transfer.fanout import ShardedConnector
    from atom_runtime.kv_transfer.ranks import LinkPlaces

    runner = executor.runner if tp > 1 else executor
    kv = rank_cache_access(runner, model_config)
    wake = Wakeup()
    ranks = [rank_connector(parsed, kv, wake)]
    links = None
    if tp > 1:
        links = LinkPlaces(list(range(1, tp)))
        addresses = {str(r): link.address for r, link in links.links.items()}
        try:
            executor.call_workers(
                "start_kv_transfer", [{"config": config.kv_transfer_config, "links": addresses}]
            )
        except BaseException:
            links.close()
            ranks[0].close()
            raise
        ranks += [links.links[r] for r in range(1, tp)]
    connector = ShardedConnector(ranks, kv.kv_heads, wake, links)
    return TransferAgent(parsed, block_manager, kv, connector, checkpoints, tp)


def rank_cache_access(runner, model_config):
    """One rank's KV cache as a transport sees it (the model's KV heads for the layout; a hybrid
    model's checkpoint layout, which both ends must share)."""
    from atom_runtime.kv_transfer.base import KVCacheAccess

    spec = getattr(runner, "checkpoint_spec", None)
    return KVCacheAccess(
        runner.model.attention_layers(),
        kv_heads=model_config.num_key_value_heads,
        state_layout=spec.layout_id if spec is not None else None,
    )


def rank_connector(config, kv, wake):
    """The transport `config` names, over one rank's cache."""
    if config.is_nixl:
        from atom_runtime.kv_transfer.nixl import NixlConnector

        return NixlConnector(config, kv, wake)
    from atom_runtime.kv_transfer.tcp import TCPConnector

    return TCPConnector(config, kv, wake=wake)


def start_rank_transport(runner, model_config, config_text: str, rank: int, address: str):
    """In a worker process: rank `rank`'s transport on kv_port + rank, linked to rank 0."""
    from atom_runtime.kv_transfer.base import Wakeup
    from atom_runtime.kv_transfer.config import KVTransferConfig
    from atom_runtime.kv_transfer.ranks import RankService

    parsed = KVTransferConfig.from_cli(config_text).for_rank(rank)
    wake = Wakeup()
    connector = rank_connector(parsed, rank_cache_access(runner, model_config), wake)
    return RankService(connector, address, wake)
