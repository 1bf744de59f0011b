"""The operator and the runtime agree: every engine argument the operator renders for every
example is accepted by `atom serve`'s parser and makes a valid EngineConfig, KV-events config and
KV-transfer config (prefill produces, decode consumes), and every router argument is accepted by
`atom router`'s parser and names Services the router can discover (rendered, headless, on the
engines' port, selecting the role's engine pods), so a rendered pod never dies on an unknown or
malformed flag and the router finds the pods it is told about."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from atom_operator.kv_events_wiring import ROUTER_KV_PORT_FLAGS, router_kv_events_problem
from atom_operator.render import render_children
from atom_operator.render.keys import KEYS_MOUNT, DeploymentKeys
from atom_operator.render.router import render_router_deployment
from atom_operator.schema.engine_features import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    SPECULATIVE_METHODS,
)
from atom_operator.spec import has_router
from atom_runtime.config import EngineConfig
from atom_runtime.kv_events import KVEventsConfig
from atom_runtime.kv_transfer.config import KVTransferConfig
from atom_runtime.router import cli as router_cli
from atom_runtime.router.config import RouterConfig
from atom_runtime.router.discovery import ServiceTarget
from atom_runtime.server import cli as serve_cli

EXAMPLES_DIR = Path(__file__).parent.parent.joinpath("examples")
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))

# Flags and fields the operator renders for runtime features built beside it (issues 33, 35, 36,
# 38, 39): each must be defined by the runtime, or a rendered pod dies on an unknown flag.
FEATURE_SERVE_FLAGS = (
    "--compile-cache-dir",
    "--quantization",
    "--kv-cache-dtype",
    "--speculative-config",
    "--reasoning-parser",
)
FEATURE_ROUTER_FLAGS = ("--kv-events-curve-dir", "--api-key")
FEATURE_KV_EVENTS_FIELDS = ("curve_keys_dir", "include_token_ids")


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atom serve", exit_on_error=False)
    serve_cli.add_arguments(parser)
    return parser


def _router_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atom router", exit_on_error=False)
    router_cli.add_arguments(parser)
    return parser


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    return parser.parse_args(args)  # raises on an unknown or malformed flag


def _kv_events(text: str, mounted_keys: Path) -> KVEventsConfig:
    """--kv-events-config as the runtime in the pod reads it: a rendered curve_keys_dir is the
    keys Secret's mount, here the Secret's files written to `mounted_keys`."""
    fields = json.loads(text)
    if "curve_keys_dir" in fields:
        assert fields["curve_keys_dir"] == KEYS_MOUNT, fields
        fields["curve_keys_dir"] = str(mounted_keys)
    return KVEventsConfig.from_cli(json.dumps(fields), environ={})


def test_the_runtime_defines_every_rendered_flag():
    missing = [f for f in FEATURE_SERVE_FLAGS if f not in _serve_parser()._option_string_actions]
    missing += [f for f in FEATURE_ROUTER_FLAGS if f not in _router_parser()._option_string_actions]
    known = {f.name for f in dataclasses.fields(KVEventsConfig)}
    missing += [f"kv-events-config:{n}" for n in FEATURE_KV_EVENTS_FIELDS if n not in known]
    assert not missing, f"the operator renders what the runtime does not define: {missing}"


@pytest.fixture
def mounted_keys(tmp_path) -> Path:
    """The deployment keys Secret as the kubelet mounts it: one file per key."""
    directory = tmp_path / "keys"
    directory.mkdir()
    for name, text in DeploymentKeys.generate().files.items():
        (directory / name).write_text(text)
    return directory


@pytest.fixture(autouse=True)
def transfer_key(monkeypatch):
    """A pod with --kv-transfer-config starts only with the deployment's transfer key, which the
    operator mounts (docs/security.md): the pods parsed here have one."""
    monkeypatch.setenv("ATOM_TRANSFER_KEY", "1f" * 32)
    monkeypatch.delenv("ATOM_TRANSFER_KEY_FILE", raising=False)


def _containers(path: Path, command: str):
    for doc in yaml.safe_load_all(path.read_text()):
        doc.setdefault("metadata", {}).setdefault("uid", "uid-1")
        yield from _containers_of(doc, command)


def _containers_of(doc: dict, command: str) -> list[tuple[str, list[str]]]:
    """(Deployment name, arguments after `command`) of each container running `command`."""
    found = []
    for child in render_children(doc):
        if child["kind"] != "Deployment":
            continue
        for c in child["spec"]["template"]["spec"]["containers"]:
            args = c.get("args") or []
            if args[:1] == [command]:
                found.append((child["metadata"]["name"], args[1:]))
    return found


def _engine_containers(path: Path):
    return _containers(path, "serve")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_rendered_engine_args_parse_as_atom_serve(example, mounted_keys):
    found = list(_engine_containers(example))
    assert found, f"{example.name} renders no engine container"
    for name, args in found:
        config = EngineConfig.from_args(_parse(_serve_parser(), args))
        if config.kv_transfer_config is not None:
            transfer = KVTransferConfig.from_cli(config.kv_transfer_config)
            want = "kv_producer" if name.endswith("-prefill") else "kv_consumer"
            assert transfer.kv_role == want, name
        assert config.block_size >= 8, name
        if config.kv_events_config:
            kv = _kv_events(config.kv_events_config, mounted_keys)
            assert kv.enable_kv_cache_events and kv.topic.startswith("kv@$(POD_IP):"), name
            assert kv.endpoint.startswith("tcp://$(POD_IP):"), name


@pytest.mark.parametrize(
    ("fields", "interval", "demand", "fraction"),
    [(None, -1, True, 0.1), ({"intervalTokens": 0, "demand": True}, 0, True, 0.1),
     ({"intervalTokens": 64, "demand": False, "memoryFraction": 0.3}, 64, False, 0.3)],
)  # fmt: skip
def test_state_checkpoint_fields_render_to_the_runtime_settings(
    fields, interval, demand, fraction, tmp_path
):
    """spec.stateCheckpoint does what it says: the rendered flags give the runtime exactly those
    settings, and the operator's defaults are the runtime's (-1, demand on, a tenth of the
    pool)."""
    doc = next(yaml.safe_load_all(EXAMPLES[0].read_text()))
    doc.setdefault("metadata", {})["uid"] = "uid-1"
    doc["spec"].pop("stateCheckpoint", None)
    if fields is not None:
        doc["spec"]["stateCheckpoint"] = fields
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(doc))
    (_, args), *_ = _engine_containers(path)
    config = EngineConfig.from_args(_parse(_serve_parser(), args))
    assert config.state_checkpoint_interval_tokens == interval
    assert config.state_checkpoint_demand is demand
    assert config.state_checkpoint_memory_fraction == fraction
    if fields is None:
        assert interval == EngineConfig().state_checkpoint_interval_tokens
        assert fraction == EngineConfig().state_checkpoint_memory_fraction


def test_the_examples_cover_both_router_modes():
    """The router test below sees a disaggregated router and an aggregated one."""
    specs = [doc["spec"] for path in EXAMPLES for doc in yaml.safe_load_all(path.read_text())]
    routed = [("prefill" in spec) for spec in specs if has_router(spec)]
    assert sorted(set(routed)) == [False, True]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_rendered_router_args_parse_as_atom_router(example):
    spec = next(yaml.safe_load_all(example.read_text()))["spec"]
    disaggregated = "prefill" in spec
    found = list(_containers(example, "router"))
    assert bool(found) == has_router(spec), example.name
    for name, args in found:
        parsed = _parse(_router_parser(), args)
        config = router_cli.config_from_args(parsed)
        # Aggregated: --decode-service alone, so the router never tries a remote prefill.
        assert config.disaggregated == disaggregated, name
        for url in config.decode_services + config.prefill_services:
            target = ServiceTarget.parse(url)
            # Discoverable: a <service>.<namespace>.svc name the EndpointSlice watch can follow.
            assert target.service and target.namespace, url
        roles = ["decode", "prefill"] if disaggregated else ["decode"]
        assert [ServiceTarget.parse(u).service.rsplit("-", 1)[1] for u in config.decode_services
                + config.prefill_services] == roles  # fmt: skip
        _assert_services_lead_to_the_engines(example, config.decode_services, "serve", "decode")
        _assert_services_lead_to_the_engines(example, config.prefill_services, "serve", "prefill")


def _assert_services_lead_to_the_engines(example: Path, urls: list[str], command: str, role: str):
    """Each URL names a rendered headless Service (the DNS fallback needs one record per pod)
    in the AtomDeployment's namespace, on its `http` port (the EndpointSlice watch reads that
    port by name), selecting exactly the pods of the role's engine Deployment, whose engine
    listens on that port."""
    doc = next(yaml.safe_load_all(example.read_text()))
    doc.setdefault("metadata", {}).setdefault("uid", "uid-1")
    children = render_children(doc)
    namespace = doc["metadata"].get("namespace", "default")
    for url in urls:
        target = ServiceTarget.parse(url)
        assert target.namespace == namespace, url
        (service,) = [c for c in children if c["kind"] == "Service"
                      and c["metadata"]["name"] == target.service]  # fmt: skip
        assert service["spec"]["clusterIP"] == "None", url
        http = {p["name"]: p for p in service["spec"]["ports"]}["http"]
        assert http["port"] == target.port, url
        (deployment,) = [c for c in children if c["kind"] == "Deployment"
                         and c["metadata"]["name"].endswith(f"-{role}")]  # fmt: skip
        selector = service["spec"]["selector"].items()
        for other in (c for c in children if c["kind"] == "Deployment"):
            labels = other["spec"]["template"]["metadata"]["labels"]
            selected = all(labels.get(k) == v for k, v in selector)
            assert selected == (other is deployment), (url, other["metadata"]["name"])
        pod = deployment["spec"]["template"]
        (engine,) = [c for c in pod["spec"]["containers"] if c["args"][:1] == [command]]
        parsed = _parse(_serve_parser(), engine["args"][1:])
        assert parsed.port == target.port, url
        assert {p["name"]: p["containerPort"] for p in engine["ports"]}["http"] == target.port


def _parse_router(args: list[str]) -> argparse.Namespace:
    return _parse(_router_parser(), args)


@pytest.mark.parametrize("mode", [{"prefill": {}}, {"router": {"enabled": True}}],
                         ids=["disaggregated", "aggregated-router"])  # fmt: skip
@pytest.mark.parametrize(
    ("events", "port", "replay"),
    [({"port": 6100, "replayPort": 6101}, 6100, 6101), ({}, 5557, 5558),
     ({"enabled": False, "port": 6100, "replayPort": 6101}, None, None)],
    ids=["custom-ports", "default-ports", "disabled"],
)  # fmt: skip
def test_rendered_router_subscribes_where_the_engines_publish(
    events, port, replay, mode, mounted_keys
):
    """The router's KV-event ports, as `atom router` parses them, are the ports the engine pods
    bind (spec.kvEvents); with KV events off the router subscribes to none."""
    body = {
        "apiVersion": "serving.atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": "pd", "namespace": "llm", "uid": "uid-1"},
        "spec": {"accelerator": {"vendor": "cpu"}, **mode, "kvEvents": events},
    }
    router = render_router_deployment(body)
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "router"
    config = router_cli.config_from_args(_parse_router(args[1:]))
    assert (config.kv_events_port, config.kv_replay_port) == (port, replay)
    for child in render_children(body):
        if child["kind"] == "Deployment" and child["metadata"]["name"] == "pd-decode":
            serve = child["spec"]["template"]["spec"]["containers"][0]["args"]
            parsed = _parse(_serve_parser(), serve[1:])
            engine = EngineConfig.from_args(parsed)
            if port is None:
                assert not engine.kv_events_config
            else:
                kv = _kv_events(engine.kv_events_config, mounted_keys)
                # The kubelet expands $(POD_IP): each pod binds its own address, never `*`.
                assert kv.endpoint == f"tcp://$(POD_IP):{port}"
                assert kv.replay_endpoint == f"tcp://$(POD_IP):{replay}"


def test_status_knows_the_routers_defaults():
    """KVEventsWired reads a router without the flags as using its defaults: they must be the
    router's real defaults."""
    parsed = _parse_router([])
    defaults = RouterConfig(backends=["http://x"])
    assert ROUTER_KV_PORT_FLAGS == {
        "--kv-events-port": defaults.kv_events_port,
        "--kv-events-replay-port": defaults.kv_replay_port,
    }
    assert (parsed.kv_events_port, parsed.kv_events_replay_port) == (5557, 5558)
    assert router_kv_events_problem(["router"], port=5557, replay_port=5558) == ""


@pytest.mark.parametrize("quantization", [None, *QUANTIZATIONS])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_every_fp8_choice_of_the_crd_renders_a_value_atom_serve_runs(quantization, kv_cache_dtype):
    """spec.engine.quantization / kvCacheDtype: each value the CRD allows becomes the runtime's
    EngineConfig field (issue 35), on the FP8 example's engine."""
    (doc,) = yaml.safe_load_all(EXAMPLES_DIR.joinpath("amd-mi300x-fp8.yaml").read_text())
    doc["metadata"]["uid"] = "uid-1"
    doc["spec"]["engine"]["kvCacheDtype"] = kv_cache_dtype
    if quantization is not None:
        doc["spec"]["engine"]["quantization"] = quantization
    (name, args), *_ = _containers_of(doc, "serve")
    config = EngineConfig.from_args(_serve_parser().parse_args(args))
    assert (config.quantization, config.kv_cache_dtype) == (quantization, kv_cache_dtype), name


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_a_container_given_the_keys_directory_mounts_the_keys_secret_there(example):
    """A rendered curve_keys_dir / --kv-events-curve-dir is where that container mounts the
    deployment's keys Secret (the runtime refuses to start when the key files are absent)."""
    for doc in yaml.safe_load_all(example.read_text()):
        doc.setdefault("metadata", {}).setdefault("uid", "uid-1")
        for child in render_children(doc):
            if child["kind"] != "Deployment":
                continue
            pod = child["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for c in pod["containers"]:
                if not any(KEYS_MOUNT in arg for arg in c.get("args") or []):
                    continue
                mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == KEYS_MOUNT]
                assert mounts, (example.name, child["metadata"]["name"], c["name"])
                secret = volumes[mounts[0]["name"]]["secret"]["secretName"]
                assert secret.endswith("-atom-keys"), secret


def _choices(flag: str) -> tuple[str, ...]:
    return tuple(_serve_parser()._option_string_actions[flag].choices)


@pytest.mark.parametrize(
    ("flag", "values"),
    [("--quantization", QUANTIZATIONS), ("--kv-cache-dtype", KV_CACHE_DTYPES),
     ("--reasoning-parser", REASONING_PARSERS)],
)  # fmt: skip
def test_the_crds_enums_are_within_the_runtimes_choices(flag, values):
    assert set(values) <= set(_choices(flag)), (flag, values, _choices(flag))


@pytest.mark.parametrize("parser", REASONING_PARSERS)
def test_every_reasoning_parser_the_crd_allows_renders_a_flag_atom_serve_takes(parser):
    """spec.engine.reasoningParser becomes --reasoning-parser with that value, which parses as
    `atom serve` (the FP8 choices: the test above)."""
    (doc,) = yaml.safe_load_all(EXAMPLES_DIR.joinpath("cpu-smollm2.yaml").read_text())
    doc.setdefault("metadata", {})["uid"] = "uid-1"
    doc["spec"]["engine"]["reasoningParser"] = parser
    (name, args), *_ = _containers_of(doc, "serve")
    parsed = _parse(_serve_parser(), args)
    EngineConfig.from_args(parsed)
    assert parsed.reasoning_parser == parser, name


def test_every_speculative_method_the_crd_allows_is_the_runtimes():
    from atom_runtime.spec_decode.config import METHODS

    assert set(SPECULATIVE_METHODS) <= set(METHODS)


@pytest.mark.parametrize("method", ["draft_model", "mtp"])
def test_a_drafting_model_under_tensor_parallelism_renders_what_atom_serve_runs(method):
    """spec.engine.speculative with decode tensorParallelSize 2: the runtime runs the drafting
    model whole on rank 0 (issue 38), so the CRD's only draftTensorParallelSize, 1, is taken."""
    (doc,) = yaml.safe_load_all(EXAMPLES_DIR.joinpath("amd-mi300x-fp8.yaml").read_text())
    doc["metadata"]["uid"] = "uid-1"
    doc["spec"]["decode"]["tensorParallelSize"] = 2
    speculative = {"method": method, "numSpeculativeTokens": 3}
    if method == "draft_model":
        speculative |= {"model": "meta-llama/Llama-3.2-1B-Instruct", "draftTensorParallelSize": 1}
    doc["spec"]["engine"]["speculative"] = speculative
    (name, args), *_ = _containers_of(doc, "serve")
    config = EngineConfig.from_args(_serve_parser().parse_args(args))
    spec = config.speculative()
    assert config.tensor_parallel_size == 2, name
    assert (spec.method, spec.draft_tensor_parallel_size) == (method, 1), name
