"""The operator and the runtime agree: every engine argument the operator renders for every
example is accepted by `atom serve`'s parser and makes a valid EngineConfig, KV-events config and
KV-transfer config (prefill produces, decode consumes), and every router argument is accepted by
`atom router`'s parser and names Services the router can discover, so a rendered pod never dies
on an unknown or malformed flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from atom_operator.render import render_children
from atom_runtime.config import EngineConfig
from atom_runtime.kv_events import KVEventsConfig
from atom_runtime.kv_transfer.config import KVTransferConfig
from atom_runtime.router import cli as router_cli
from atom_runtime.router.discovery import ServiceTarget
from atom_runtime.server import cli as serve_cli

EXAMPLES = sorted(Path(__file__).parent.parent.joinpath("examples").glob("*.yaml"))


def _containers(path: Path, command: str):
    for doc in yaml.safe_load_all(path.read_text()):
        doc.setdefault("metadata", {}).setdefault("uid", "uid-1")
        for child in render_children(doc):
            if child["kind"] != "Deployment":
                continue
            for c in child["spec"]["template"]["spec"]["containers"]:
                args = c.get("args") or []
                if args[:1] == [command]:
                    yield child["metadata"]["name"], args[1:]


def _engine_containers(path: Path):
    return _containers(path, "serve")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_rendered_engine_args_parse_as_atom_serve(example):
    found = list(_engine_containers(example))
    assert found, f"{example.name} renders no engine container"
    for name, args in found:
        parser = argparse.ArgumentParser(prog="atom serve", exit_on_error=False)
        serve_cli.add_arguments(parser)
        parsed = parser.parse_args(args)  # raises on an unknown or malformed flag
        config = EngineConfig.from_args(parsed)
        if config.kv_transfer_config is not None:
            transfer = KVTransferConfig.from_cli(config.kv_transfer_config)
            want = "kv_producer" if name.endswith("-prefill") else "kv_consumer"
            assert transfer.kv_role == want, name
        assert config.block_size >= 8, name
        if config.kv_events_config:
            kv = KVEventsConfig.from_cli(config.kv_events_config, environ={})
            assert kv.enable_kv_cache_events and kv.topic.startswith("kv@$(POD_IP):"), name


@pytest.mark.parametrize(
    ("fields", "interval", "demand"),
    [(None, -1, True), ({"intervalTokens": 0, "demand": True}, 0, True),
     ({"intervalTokens": 64, "demand": False}, 64, False)],
)  # fmt: skip
def test_state_checkpoint_fields_render_to_the_runtime_settings(fields, interval, demand, tmp_path):
    """spec.stateCheckpoint does what it says: the rendered flags give the runtime exactly those
    settings, and the operator's defaults are the runtime's (-1, demand on)."""
    doc = next(yaml.safe_load_all(EXAMPLES[0].read_text()))
    doc.setdefault("metadata", {})["uid"] = "uid-1"
    doc["spec"].pop("stateCheckpoint", None)
    if fields is not None:
        doc["spec"]["stateCheckpoint"] = fields
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(doc))
    (_, args), *_ = _engine_containers(path)
    parser = argparse.ArgumentParser(prog="atom serve", exit_on_error=False)
    serve_cli.add_arguments(parser)
    config = EngineConfig.from_args(parser.parse_args(args))
    assert config.state_checkpoint_interval_tokens == interval
    assert config.state_checkpoint_demand is demand
    if fields is None:
        assert interval == EngineConfig().state_checkpoint_interval_tokens


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_rendered_router_args_parse_as_atom_router(example):
    disaggregated = any("prefill:" in line for line in example.read_text().splitlines())
    found = list(_containers(example, "router"))
    assert bool(found) == disaggregated, example.name
    for name, args in found:
        parser = argparse.ArgumentParser(prog="atom router", exit_on_error=False)
        router_cli.add_arguments(parser)
        parsed = parser.parse_args(args)  # raises on an unknown or malformed flag
        config = router_cli.config_from_args(parsed)
        assert config.disaggregated, name
        for url in config.decode_services + config.prefill_services:
            target = ServiceTarget.parse(url)
            # Discoverable: a <service>.<namespace>.svc name the EndpointSlice watch can follow.
            assert target.service and target.namespace, url
        assert [ServiceTarget.parse(u).service.rsplit("-", 1)[1] for u in config.decode_services
                + config.prefill_services] == ["decode", "prefill"]  # fmt: skip
