"""Pure status folding: every role verdict, phase and condition, with exact values."""

from __future__ import annotations

import json

import pytest

from atom_operator.kv_events_wiring import kv_events_problem, router_kv_events_problem
from atom_operator.render import render_children
from atom_operator.role_deployment import RoleDeployment, role_state, summarize_deployment
from atom_operator.status import fold_status, status_changes

NOW, EARLIER = "2026-01-02T00:00:00Z", "2026-01-01T00:00:00Z"
UID = "uid-1"
TOPIC = "kv@$(POD_IP):5557@m"
KV_ARGS = ("serve", "--kv-events-config", json.dumps({"endpoint": "tcp://*:5557", "topic": TOPIC}))
ROUTER_ARGS = ("atom", "router", "--kv-events-port", "5557", "--kv-events-replay-port", "5558")


def body(spec=None, generation=1, status=None):
    return {
        "apiVersion": "serving.atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": "chat", "namespace": "ns1", "uid": UID, "generation": generation},
        "spec": {"model": {"name": "m"}, "accelerator": {"vendor": "cpu"}, **(spec or {})},
        "status": status or {},
    }


def deployment(role="decode", **fields):
    values = dict(
        name=f"chat-{role}", role=role, owner_uid=UID, generation=1, desired=1, replicas=1,
        ready=1, updated=1, observed_generation=1, rollout_complete=True,
        args=KV_ARGS if role != "router" else ROUTER_ARGS, env=("POD_IP",),
    )  # fmt: skip
    values.update(fields)
    return RoleDeployment(**values)


def fold(obj, deployments, applied=1):
    return fold_status(
        obj, deployments, applied_generation=applied, endpoint="http://e/v1", now=NOW
    )


def conditions(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def _condition(status, kind):
    return next(c for c in status["conditions"] if c["type"] == kind)


@pytest.mark.parametrize(
    ("d", "ready", "reason", "degraded", "pending"),
    [
        (None, False, "DeploymentMissing", False, True),
        (deployment(failure="ProgressDeadlineExceeded: x"), False, "RolloutFailed", True, False),
        (deployment(desired=0, replicas=0, ready=0, updated=0), False, "ScaledToZero", False, True),
        (deployment(observed_generation=0), False, "RollingOut", False, False),
        (deployment(desired=2, updated=1, replicas=2), False, "RollingOut", False, False),
        (deployment(replicas=2), False, "RollingOut", False, False),
        (deployment(ready=0, rollout_complete=False), False, "PodsStarting", False, False),
        (deployment(ready=0), False, "PodsNotReady", True, False),
        (deployment(), True, "AllPodsReady", False, False),
    ],
)
def test_role_state(d, ready, reason, degraded, pending):
    state = role_state("decode", d)
    assert (state.ready, state.reason, state.degraded, state.pending) == (
        ready, reason, degraded, pending
    )  # fmt: skip


def test_ready_aggregated_status_exact():
    status = fold(body(), [deployment()])
    assert status == {
        "phase": "Ready",
        "endpoint": "http://e/v1",
        "model": "m",
        "roles": {
            "decode": {
                "replicas": 1,
                "readyReplicas": 1,
                "updatedReplicas": 1,
                "desiredReplicas": 1,
                "selector": "",
                "ready": "1/1",
            },
            "prefill": None,
            "router": None,
        },
        "conditions": [
            {"type": "SpecValid", "status": "True", "reason": "Valid",
             "message": "the spec is valid", "lastTransitionTime": NOW, "observedGeneration": 1},
            {"type": "DecodeReady", "status": "True", "reason": "AllPodsReady",
             "message": "chat-decode: 1/1 pods ready", "lastTransitionTime": NOW,
             "observedGeneration": 1},
            {"type": "KVEventsWired", "status": "True", "reason": "ArgsWired",
             "message": "engine pods publish on port 5557", "lastTransitionTime": NOW,
             "observedGeneration": 1},
            {"type": "Ready", "status": "True", "reason": "AllComponentsReady",
             "message": "ready: decode", "lastTransitionTime": NOW, "observedGeneration": 1},
        ],
    }  # fmt: skip


def test_disaggregated_needs_prefill_and_router_before_ready():
    obj = body({"prefill": {"replicas": 1}})
    status = fold(obj, [deployment(), deployment("prefill")])
    assert conditions(status) == {
        "SpecValid": ("True", "Valid"),
        "DecodeReady": ("True", "AllPodsReady"),
        "PrefillReady": ("True", "AllPodsReady"),
        "RouterReady": ("False", "DeploymentMissing"),
        # The router subscribes to the KV events: without it nothing consumes them.
        "KVEventsWired": ("False", "ArgsMissing"),
        "Ready": ("False", "ComponentsNotReady"),
    }
    assert status["phase"] == "Pending"
    status = fold(obj, [deployment(), deployment("prefill"), deployment("router")])
    assert status["phase"] == "Ready"
    assert conditions(status)["RouterReady"] == ("True", "AllPodsReady")
    assert set(status["roles"]) == {"decode", "prefill", "router"}


def test_aggregated_router_needs_the_router_before_ready():
    """router.enabled without a prefill role: RouterReady and the router's KV-event
    subscription count as in disaggregated mode; there is no PrefillReady."""
    obj = body({"router": {"enabled": True}})
    status = fold(obj, [deployment()])
    assert conditions(status) == {
        "SpecValid": ("True", "Valid"),
        "DecodeReady": ("True", "AllPodsReady"),
        "RouterReady": ("False", "DeploymentMissing"),
        "KVEventsWired": ("False", "ArgsMissing"),
        "Ready": ("False", "ComponentsNotReady"),
    }
    assert _condition(status, "KVEventsWired")["message"] == "router: no Deployment yet"
    assert status["phase"] == "Pending"
    status = fold(obj, [deployment(), deployment("router")])
    assert status["phase"] == "Ready"
    assert _condition(status, "KVEventsWired")["message"] == (
        "engine pods publish on port 5557; the router subscribes on 5557 (replay 5558)"
    )
    assert _condition(status, "Ready")["message"] == "ready: decode, router"
    assert status["roles"]["prefill"] is None
    assert status["roles"]["router"]["ready"] == "1/1"
    # The same pods with the router off: a router Deployment left over is not reported.
    status = fold(body({"router": {"enabled": False}}), [deployment(), deployment("router")])
    assert "RouterReady" not in conditions(status)
    assert status["roles"]["router"] is None


def test_invalid_spec_is_failed_and_names_the_field():
    status = fold(body({"decode": {"replicas": -1}}), [deployment()])
    assert status["phase"] == "Failed"
    spec_valid = status["conditions"][0]
    assert (spec_valid["status"], spec_valid["reason"], spec_valid["message"]) == (
        "False", "InvalidSpec", "spec.decode.replicas: must be >= 0, got -1"
    )  # fmt: skip
    assert conditions(status)["Ready"] == ("False", "SpecInvalid")


def test_unapplied_generation_is_progressing_never_ready():
    status = fold(body(generation=2), [deployment()], applied=1)
    assert status["phase"] == "Progressing"
    ready = status["conditions"][-1]
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == (
        "False", "Reconciling", 1
    )  # fmt: skip
    assert status["conditions"][0]["observedGeneration"] == 2  # SpecValid: the current spec


def test_degraded_beats_pending_and_progressing():
    obj = body({"prefill": {"replicas": 1}})
    status = fold(obj, [deployment(ready=0), deployment("prefill", observed_generation=0)])
    assert status["phase"] == "Degraded"
    assert fold(obj, [deployment("prefill", observed_generation=0)])["phase"] == "Pending"
    assert fold(obj, [deployment(), deployment("prefill", ready=0, rollout_complete=False),
                      deployment("router")])["phase"] == "Progressing"  # fmt: skip


def test_kv_events_disabled_is_reported_and_not_required():
    status = fold(body({"kvEvents": {"enabled": False}}), [deployment(args=())])
    assert conditions(status)["KVEventsWired"] == ("False", "Disabled")
    assert status["phase"] == "Ready"


def test_kv_events_enabled_but_not_wired_is_degraded():
    status = fold(body(), [deployment(args=("serve",))])
    assert conditions(status)["KVEventsWired"] == ("False", "ArgsMissing")
    assert conditions(status)["Ready"] == ("False", "KVEventsNotWired")
    assert status["phase"] == "Degraded"


def test_children_of_another_owner_are_ignored():
    status = fold(body(), [deployment(owner_uid="someone-else")])
    assert conditions(status)["DecodeReady"] == ("False", "DeploymentMissing")


def test_last_transition_time_moves_only_when_status_changes():
    before = {"conditions": [
        {"type": "SpecValid", "status": "True", "lastTransitionTime": EARLIER},
        {"type": "DecodeReady", "status": "False", "lastTransitionTime": EARLIER},
    ]}  # fmt: skip
    status = fold(body(status=before), [deployment()])
    times = {c["type"]: c["lastTransitionTime"] for c in status["conditions"]}
    assert times["SpecValid"] == EARLIER
    assert times["DecodeReady"] == NOW


def test_endpoint_none_keeps_the_previous_one():
    obj = body(status={"endpoint": "http://old/v1"})
    status = fold_status(obj, [], applied_generation=1, endpoint=None, now=NOW)
    assert status["endpoint"] == "http://old/v1"


@pytest.mark.parametrize(
    ("args", "env", "problem"),
    [
        (KV_ARGS, ("POD_IP",), ""),
        (("serve",), (), "no --kv-events-config argument"),
        (("--kv-events-config", "{"), (), "--kv-events-config is not JSON: '{'"),
        (("--kv-events-config=" + json.dumps({"endpoint": "tcp://*:9", "topic": TOPIC}),),
         ("POD_IP",), "publisher endpoint 'tcp://*:9' is not on spec.kvEvents.port 5557"),
        (("--kv-events-config", json.dumps({"endpoint": "tcp://*:5557", "topic": "kv@x:5557@other"})),
         (), "topic 'kv@x:5557@other' is not kv@<pod-ip>:5557@m"),
        (KV_ARGS, (), f"'{TOPIC}' refers to $(POD_IP), which the container does not set"),
        # Escaped for the kubelet: a literal `$(POD_IP)` is no pod address.
        (("--kv-events-config", json.dumps({"endpoint": "tcp://*:5557",
                                             "topic": "kv@$$(POD_IP):5557@m"})),
         ("POD_IP",), "topic 'kv@$$(POD_IP):5557@m' is not kv@<pod-ip>:5557@m"),
        (("--kv-events-config", json.dumps({"endpoint": "tcp://$(HOST_IP):5557",
                                             "topic": TOPIC})),
         ("POD_IP",), "'tcp://$(HOST_IP):5557' refers to $(HOST_IP), which the container does "
                      "not set"),
    ],
)  # fmt: skip
def test_kv_events_problem(args, env, problem):
    assert kv_events_problem(args, env, port=5557, model="m") == problem


def test_summarize_deployment_reads_spec_status_and_engine_container():
    obj = {
        "metadata": {
            "name": "chat-decode", "generation": 3,
            "labels": {"serving.atom.dev/role": "decode"},
            "ownerReferences": [{"uid": "other"}, {"uid": UID, "controller": True}],
        },
        "spec": {
            "replicas": 4,
            "selector": {"matchLabels": {"b": "2", "a": "1"}},
            "template": {"spec": {"containers": [
                {"name": "sidecar", "args": ["x"]},
                {"name": "engine", "command": ["atom"], "args": ["serve"],
                 "env": [{"name": "POD_IP"}]},
            ]}},
        },
        "status": {
            "observedGeneration": 3, "replicas": 4, "readyReplicas": 2, "updatedReplicas": 3,
            "conditions": [{"type": "Progressing", "status": "False",
                            "reason": "ProgressDeadlineExceeded", "message": "slow"}],
        },
    }  # fmt: skip
    assert summarize_deployment(obj) == RoleDeployment(
        name="chat-decode", role="decode", owner_uid=UID, generation=3, desired=4, replicas=4,
        ready=2, updated=3, observed_generation=3, selector="a=1,b=2",
        failure="ProgressDeadlineExceeded: slow", rollout_complete=False,
        args=("atom", "serve"), env=("POD_IP",),
    )  # fmt: skip
    assert summarize_deployment({"metadata": {"name": "x", "labels": {}}}) is None


def test_status_changes_only_what_differs_and_nulls_removed_roles():
    current = {"phase": "Ready", "roles": {"decode": {"ready": "1/1"}, "prefill": {"ready": "1/1"}}}
    folded = {"phase": "Ready", "roles": {"decode": {"ready": "1/1"}, "prefill": None}}
    assert status_changes(current, folded) == {"roles": {"prefill": None}}
    assert status_changes(folded | {"roles": {"decode": {"ready": "1/1"}}}, folded) == {}


def test_a_role_scaled_to_zero_by_its_autoscaler_is_ready_not_pending():
    resting = {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                               "targetRequestsWaiting": 2}}  # fmt: skip
    obj = body({"prefill": resting})
    zero = deployment("prefill", desired=0, replicas=0, ready=0, updated=0)
    status = fold(obj, [deployment(), zero, deployment("router")])
    assert conditions(status)["PrefillReady"] == ("True", "ScaledToZero")
    assert (status["phase"], conditions(status)["Ready"]) == (
        "Ready",
        ("True", "AllComponentsReady"),
    )
    # A pod still terminating is not at rest yet; a role without minReplicas 0 is Pending at 0.
    leaving = deployment("prefill", desired=0, replicas=1, ready=1, updated=1)
    status = fold(obj, [deployment(), leaving, deployment("router")])
    assert conditions(status)["PrefillReady"] == ("False", "ScaledToZero")
    status = fold(body({"prefill": {"replicas": 0}}), [deployment(), zero, deployment("router")])
    assert (conditions(status)["PrefillReady"], status["phase"]) == (
        ("False", "ScaledToZero"), "Pending")  # fmt: skip


def test_decode_at_zero_behind_an_aggregated_router_is_ready_not_pending():
    """Decode rests at zero wherever the router holds requests, aggregated mode included."""
    resting = {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                               "targetRequestsRunning": 4}}  # fmt: skip
    zero = deployment(desired=0, replicas=0, ready=0, updated=0)
    status = fold(body({"router": {"enabled": True}, "decode": resting}),
                  [zero, deployment("router")])  # fmt: skip
    assert conditions(status)["DecodeReady"] == ("True", "ScaledToZero")
    assert (status["phase"], conditions(status)["Ready"]) == (
        "Ready",
        ("True", "AllComponentsReady"),
    )
    # Without the router the spec is refused (nothing would hold the requests).
    status = fold(body({"decode": resting}), [zero])
    assert status["phase"] == "Failed"
    assert _condition(status, "SpecValid")["message"].startswith(
        "spec.decode.autoscaling.minReplicas: decode scales to zero only behind the router"
    )


@pytest.mark.parametrize(
    ("ready", "complete", "reason", "phase"),
    [(0, True, "PodsNotReady", "Degraded"), (0, False, "PodsStarting", "Progressing"),
     (1, True, "AllPodsReady", "Ready")],
)  # fmt: skip
def test_router_ready_follows_the_router_deployments_ready_replicas(ready, complete, reason, phase):
    obj = body({"prefill": {"replicas": 1}})
    router = deployment("router", ready=ready, rollout_complete=complete)
    status = fold(obj, [deployment(), deployment("prefill"), router])
    assert conditions(status)["RouterReady"] == (str(ready == 1), reason)
    assert status["roles"]["router"]["readyReplicas"] == ready
    assert status["phase"] == phase


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (ROUTER_ARGS, ""),
        (("router",), ""),  # the router's defaults are 5557/5558
        (("router", "--kv-events-port=5557", "--kv-events-replay-port=5558"), ""),
        (("router", "--kv-events-port", "6000"),
         "--kv-events-port 6000, spec.kvEvents wants 5557"),
        (("router", "--kv-events-port", "0", "--kv-events-replay-port", "0"),
         "--kv-events-port 0, spec.kvEvents wants 5557; "
         "--kv-events-replay-port 0, spec.kvEvents wants 5558"),
    ],
)  # fmt: skip
def test_router_kv_events_problem(args, problem):
    assert router_kv_events_problem(args, port=5557, replay_port=5558) == problem


def test_router_with_other_ports_is_not_wired():
    obj = body({"prefill": {"replicas": 1}, "kvEvents": {"port": 6000, "replayPort": 6001}})
    engine = ("serve", "--kv-events-config",
              json.dumps({"endpoint": "tcp://*:6000", "topic": "kv@$(POD_IP):6000@m"}))  # fmt: skip
    roles = [deployment(args=engine), deployment("prefill", args=engine)]
    status = fold(obj, [*roles, deployment("router")])  # the router still on 5557/5558
    assert conditions(status)["KVEventsWired"] == ("False", "ArgsMissing")
    assert _condition(status, "KVEventsWired")["message"] == (
        "router (chat-router): --kv-events-port 5557, spec.kvEvents wants 6000; "
        "--kv-events-replay-port 5558, spec.kvEvents wants 6001"
    )
    assert status["phase"] == "Degraded"
    wired = ("router", "--kv-events-port", "6000", "--kv-events-replay-port", "6001")
    status = fold(obj, [*roles, deployment("router", args=wired)])
    assert conditions(status)["KVEventsWired"] == ("True", "ArgsWired")
    assert status["phase"] == "Ready"


def _live(child, ready):
    """A rendered Deployment as the API server would report it with `ready` pods ready."""
    live = json.loads(json.dumps(child))
    live["metadata"]["generation"] = 1
    replicas = live["spec"].get("replicas", 1)
    live["status"] = {
        "observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas,
        "readyReplicas": ready if ready is not None else replicas,
        "conditions": [{"type": "Progressing", "status": "True",
                        "reason": "NewReplicaSetAvailable"}],
    }  # fmt: skip
    return live


@pytest.mark.parametrize(
    ("mode", "roles"),
    [({"prefill": {"replicas": 1}}, {"decode", "prefill", "router"}),
     ({"router": {"enabled": True}}, {"decode", "router"})],
    ids=["disaggregated", "aggregated-router"],
)  # fmt: skip
@pytest.mark.parametrize(
    "events",
    [{"port": 6000, "replayPort": 6001}, {}, {"enabled": False}],
    ids=["custom-ports", "default-ports", "disabled"],
)
def test_rendered_children_fold_to_wired_and_ready(events, mode, roles):
    """What the operator renders, reported back by the cluster, is what the status calls wired:
    the engine and router Deployments carry matching KV-event ports."""
    obj = body({**mode, "kvEvents": events})
    children = render_children(obj)
    deployments = [summarize_deployment(_live(c, None)) for c in children
                   if c["kind"] == "Deployment"]  # fmt: skip
    assert {d.role for d in deployments} == roles
    status = fold(obj, deployments)
    if events.get("enabled") is False:
        assert conditions(status)["KVEventsWired"] == ("False", "Disabled")
    else:
        assert conditions(status)["KVEventsWired"] == ("True", "ArgsWired")
    assert conditions(status)["RouterReady"] == ("True", "AllPodsReady")
    assert status["phase"] == "Ready"
    router = next(c for c in children if c["metadata"]["name"] == "chat-router"
                  and c["kind"] == "Deployment")  # fmt: skip
    status = fold(obj, [d for d in deployments if d.role != "router"]
                  + [summarize_deployment(_live(router, 0))])  # fmt: skip
    assert conditions(status)["RouterReady"] == ("False", "PodsNotReady")
    assert status["phase"] == "Degraded"
