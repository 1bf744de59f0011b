"""Whether the rendered (or live) containers publish and subscribe KV events where the spec says:
the engines' `--kv-events-config` and the router's port flags, read back from their args."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable

from atom_operator.render.kubelet_expansion import expand, references

KV_EVENTS_FLAG = "--kv-events-config"
# `atom router`'s KV-event flags and their defaults (RouterConfig in
# runtime/atom_runtime/router/app.py; tests/test_render_to_serve.py checks they agree).
ROUTER_KV_PORT_FLAGS = {"--kv-events-port": 5557, "--kv-events-replay-port": 5558}
POD_ADDRESS = "10.0.0.1"


def kv_events_problem(args: Iterable[str], env: Iterable[str], *, port: int, model: str) -> str:
    """Why an engine container with these args and env variables does not publish KV events on
    `port` under a `kv@<pod-ip>:<port>@<model>` topic ("" when it does)."""
    words: list[str] = []
    for arg in args:
        # A shell script line (`sh -c "... --flag x"`) is read as the words the shell sees.
        is_script = KV_EVENTS_FLAG in arg and " " in arg and not arg.startswith(KV_EVENTS_FLAG)
        words += shlex.split(arg) if is_script else [arg]
    value = _flag_value(words, KV_EVENTS_FLAG)
    if value is None:
        return f"no {KV_EVENTS_FLAG} argument"
    try:
        config = json.loads(value)
    except ValueError:
        return f"{KV_EVENTS_FLAG} is not JSON: {value!r}"
    if not isinstance(config, dict):
        return f"{KV_EVENTS_FLAG} is not a JSON object"
    endpoint, topic = str(config.get("endpoint") or ""), str(config.get("topic") or "")
    if not endpoint.endswith(f":{port}"):
        return f"publisher endpoint {endpoint!r} is not on spec.kvEvents.port {port}"
    env = set(env)
    for text in (endpoint, topic):
        for variable in references(text):
            if variable not in env:
                return f"{text!r} refers to $({variable}), which the container does not set"
    # The topic as the kubelet expands it, with a stand-in for the pod's address.
    expanded = expand(topic, {name: POD_ADDRESS for name in env})
    if not re.fullmatch(rf"kv@[^@:$]+:{port}@{re.escape(model)}", expanded):
        return f"topic {topic!r} is not kv@<pod-ip>:{port}@{model}"
    return ""


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of the last `flag V` or `flag=V` in `args` (argparse keeps the last), or None."""
    value = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def router_kv_events_problem(args: Iterable[str], *, port: int, replay_port: int) -> str:
    """Why a router container with these args does not subscribe to the decode pods' KV events
    on `port` and replay on `replay_port` ("" when it does)."""
    args = list(args)
    problems = []
    for (flag, default), want in zip(
        ROUTER_KV_PORT_FLAGS.items(), (port, replay_port), strict=True
    ):
        value = _flag_value(args, flag)
        got = default if value is None else value
        if str(got) != str(want):
            shown = f"{flag} {value}" if value is not None else f"no {flag} (default {default})"
            problems.append(f"{shown}, spec.kvEvents wants {want}")
    return "; ".join(problems)
