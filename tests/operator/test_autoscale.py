"""The built-in autoscaler's decision function on synthetic metric series (no cluster, no clock).

`simulate` plays the loop the operator runs: every 10 s each of the role's `current` pods reports
an equal share of the load, `decide` answers, and its answer becomes the next `current`. The
expected replica counts are worked out by hand in each test's comment.
"""

from __future__ import annotations

import math

import pytest

from atom_operator.autoscale import (
    History,
    MetricsError,
    PodMetrics,
    Policy,
    bucket_increase,
    decide,
    histogram_quantile,
    parse_engine_metrics,
    parse_router_queue,
)

INTERVAL = 10.0
WAITING = Policy(
    min_replicas=1,
    max_replicas=10,
    target_requests_waiting=2,
    scale_up_stabilization_s=0,
    scale_down_stabilization_s=60,
    max_step=2,
    scale_to_zero_after_s=30,
)


def pods(current: int, *, waiting: float = 0.0, running: float = 0.0, kv: float = 0.0) -> list:
    """`current` pods sharing the role's total load equally."""
    return [
        PodMetrics(f"p{i}", waiting / current, running / current, kv / current)
        for i in range(current)
    ]


def simulate(policy: Policy, totals: list[float], *, start: int = 1, field: str = "waiting"):
    current, history, answers, decisions = start, History(), [], []
    for step, total in enumerate(totals):
        decision, history = decide(
            policy,
            now=step * INTERVAL,
            current=current,
            pods=pods(current, **{field: total}),
            router_queued=None,
            history=history,
        )
        answers.append(decision.desired)
        decisions.append(decision)
        current = decision.desired
    return answers, decisions


def test_step_surges_up_at_most_doubling_each_decision():
    # 12 waiting / target 2 = 6 pods. From 1: a surge (6 >= 2 x 1) may add max(2, 1) -> 3;
    # from 3: 6 >= 2 x 3 is still a surge, may add max(2, 3) -> 6; then steady.
    answers, decisions = simulate(WAITING, [0, 0, 12, 12, 12, 12])
    assert answers == [1, 1, 3, 6, 6, 6]
    assert decisions[2].reason.startswith("surge: requestsWaiting 12/pod vs target 2")


def test_ramp_follows_the_load_one_pod_at_a_time():
    # total waiting 2, 4, ... 12: 2/1 pod is on target; 4 -> 2 pods (a surge from 1); then
    # 6/2 pods -> 3, 8/3 -> 4, 10/4 -> 5, 12/5 -> 6 (each below 2x: plain scale-up).
    answers, _ = simulate(WAITING, [2, 4, 6, 8, 10, 12])
    assert answers == [1, 2, 3, 4, 5, 6]


def test_spike_scales_up_fast_and_down_only_after_the_stabilization_window():
    # t=10: 40 waiting wants 20 pods, above max 10 (limited), surge step 1 -> 3. The 20 stays in
    # the 60 s scale-down window until t=80, when the window holds only zeros: 3 - 2 -> 1.
    answers, decisions = simulate(WAITING, [0, 40, 0, 0, 0, 0, 0, 0, 0, 0])
    assert answers == [1, 3, 3, 3, 3, 3, 3, 3, 1, 1]
    assert decisions[1].limited == "max"
    assert "limited by maxReplicas 10 (wants 20)" in decisions[1].reason
    assert [d.limited for d in decisions[2:]] == [""] * 8


def test_flapping_load_does_not_flap_the_replicas():
    # 8 waiting on 1 pod -> surge to 3; 2 on 3 wants 1 but the window remembers 4: hold 3;
    # 8 on 3 wants 4 (not a surge) -> 4; afterwards 2 wants 1 (held) and 8 on 4 is on target.
    answers, _ = simulate(WAITING, [8, 2, 8, 2, 8, 2, 8, 2])
    assert answers == [3, 3, 4, 4, 4, 4, 4, 4]


def test_at_max_replicas_the_role_is_reported_limited_not_silently_saturated():
    decision, _ = decide(
        WAITING, now=0, current=10, pods=pods(10, waiting=40), router_queued=None,
        history=History(),
    )  # fmt: skip
    assert (decision.desired, decision.recommended, decision.limited) == (10, 20, "max")


def test_scale_up_stabilization_waits_for_a_sustained_rise_but_not_for_a_surge():
    policy = Policy(min_replicas=1, max_replicas=10, target_requests_waiting=2,
                    scale_up_stabilization_s=20, scale_down_stabilization_s=60, max_step=2)  # fmt: skip
    # current 4: 10 waiting wants 5 (not a surge): held until the whole 20 s window wants 5.
    answers, _ = simulate(policy, [8, 10, 10, 10], start=4)
    assert answers == [4, 4, 4, 5]
    # 20 waiting wants 10 >= 2 x 4: acts at once, step max(2, 4) -> 8.
    answers, _ = simulate(policy, [8, 20], start=4)
    assert answers == [4, 8]


def test_decode_scales_on_running_requests_and_kv_usage_whichever_wants_more():
    policy = Policy(min_replicas=1, max_replicas=8, target_requests_running=32,
                    target_kv_cache_usage=0.8, scale_down_stabilization_s=0, max_step=4)  # fmt: skip
    # 2 pods: 40 running in all (20/pod, wants ceil(40/32) = 2), KV 1.7 in all (0.85/pod, within
    # 10% of 0.8: hold 2) -> 2.  Then KV 3.0 (1.5/pod) wants ceil(3.0/0.8) = 4 -> 4.
    d1, h = decide(policy, now=0, current=2, pods=pods(2, running=40, kv=1.7),
                   router_queued=None, history=History())  # fmt: skip
    d2, _ = decide(policy, now=10, current=2, pods=pods(2, running=40, kv=3.0),
                   router_queued=None, history=h)  # fmt: skip
    assert (d1.desired, d2.desired) == (2, 4)
    assert "kvCacheUsage 1.5/pod vs target 0.8" in d2.reason


def test_a_pod_without_metrics_never_causes_a_scale_down_and_adds_no_load():
    policy = Policy(min_replicas=1, max_replicas=10, target_requests_waiting=2,
                    scale_down_stabilization_s=0, max_step=4)  # fmt: skip
    silent = PodMetrics("p2", error="ClientConnectorError: refused")
    # Shrinking: 1 + 1 waiting wants 1 pod; the silent pod counts at the target -> 2, not 1.
    busy = [PodMetrics("p0", 1, 0, 0), PodMetrics("p1", 1, 0, 0), silent]
    decision, _ = decide(policy, now=0, current=3, pods=busy, router_queued=None,
                         history=History())  # fmt: skip
    assert (decision.recommended, decision.desired) == (2, 2)
    # Growing: 4 + 4 waiting wants 4; the silent pod adds nothing -> 4, not 5.
    busy = [PodMetrics("p0", 4, 0, 0), PodMetrics("p1", 4, 0, 0), silent]
    decision, _ = decide(policy, now=0, current=3, pods=busy, router_queued=None,
                         history=History())  # fmt: skip
    assert (decision.recommended, decision.desired) == (4, 4)
    assert decision.metrics["podsWithoutMetrics"] == 1


def test_a_pod_returning_garbage_is_a_pod_without_metrics():
    with pytest.raises(MetricsError, match="not the Prometheus text format"):
        parse_engine_metrics("p0", "<html>{{{ 502 Bad Gateway")
    with pytest.raises(MetricsError, match="no atom:requests_running"):
        parse_engine_metrics("p0", "atom:requests_waiting 1\natom:kv_cache_usage_ratio 0.5\n")
    with pytest.raises(MetricsError, match="atom:requests_waiting is nan"):
        parse_engine_metrics("p0", "atom:requests_waiting NaN\n")
    # Every pod broken: hold the replicas (within bounds), never guess.
    broken = [PodMetrics("p0", error="MetricsError: garbage")] * 3
    decision, _ = decide(WAITING, now=0, current=3, pods=broken, router_queued=None,
                         history=History())  # fmt: skip
    assert decision.desired == 3
    assert decision.reason.startswith("no usable metrics from 3 ready pod(s); holding")


def test_engine_exposition_is_parsed_with_its_ttft_buckets():
    text = (
        "# TYPE atom:requests_running gauge\natom:requests_running 3.0\n"
        "# TYPE atom:requests_waiting gauge\natom:requests_waiting 5.0\n"
        "# TYPE atom:kv_cache_usage_ratio gauge\natom:kv_cache_usage_ratio 0.25\n"
        "# TYPE atom:time_to_first_token_seconds histogram\n"
        'atom:time_to_first_token_seconds_bucket{le="0.5"} 10.0\n'
        'atom:time_to_first_token_seconds_bucket{le="1.0"} 20.0\n'
        'atom:time_to_first_token_seconds_bucket{le="+Inf"} 20.0\n'
        "atom:time_to_first_token_seconds_count 20.0\n"
        "atom:time_to_first_token_seconds_sum 11.0\n"
    )
    parsed = parse_engine_metrics("p0", text)
    assert (parsed.requests_waiting, parsed.requests_running, parsed.kv_cache_usage) == (5, 3, 0.25)
    assert parsed.ttft_buckets == ((0.5, 10.0), (1.0, 20.0), (math.inf, 20.0))


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (math.inf, 20.0)]
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.9)  # 0.5 + 0.5 * 8/10
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.3)  # 0.1 + 0.4 * 5/10
    assert histogram_quantile(0.9, [(0.5, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.9, [(0.5, 1.0), (math.inf, 10.0)]) == 0.5  # above the last bound
    # Increase between scrapes; a restarted engine (counts went down) starts over.
    assert bucket_increase([(0.5, 12.0), (math.inf, 15.0)], [(0.5, 10.0), (math.inf, 10.0)]) == (
        (0.5, 2.0), (math.inf, 5.0))  # fmt: skip
    assert bucket_increase([(0.5, 1.0), (math.inf, 1.0)], [(0.5, 10.0), (math.inf, 10.0)]) == (
        (0.5, 1.0), (math.inf, 1.0))  # fmt: skip


def test_ttft_p90_since_the_previous_scrape_drives_scale_up():
    policy = Policy(min_replicas=1, max_replicas=4, target_ttft_p90_seconds=0.45)
    first = PodMetrics("p0", 0, 0, 0, ((0.1, 0.0), (0.5, 0.0), (1.0, 0.0), (math.inf, 0.0)))
    later = PodMetrics("p0", 0, 0, 0, ((0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (math.inf, 20.0)))
    d1, h = decide(policy, now=0, current=1, pods=[first], router_queued=None, history=History())
    assert (d1.desired, "ttftP90Seconds" in d1.metrics) == (1, False)  # no request yet
    # 20 first tokens since: p90 0.9 s = 2 x 0.45 -> 2 pods (a surge from 1).
    d2, _ = decide(policy, now=10, current=1, pods=[later], router_queued=None, history=h)
    assert (d2.desired, d2.metrics["ttftP90Seconds"]) == (2, 0.9)


def test_scale_to_zero_after_idle_time_and_back_on_router_demand():
    policy = Policy(min_replicas=0, max_replicas=3, target_requests_waiting=2,
                    scale_to_zero_after_s=30)  # fmt: skip
    current, history, answers = 1, History(), []
    # idle at t=0..30 (idle since 0) -> 0 at t=30; at zero nothing queued -> 0; 3 queued -> 1.
    for step, queued in enumerate([0, 0, 0, 0, 0, 3, 0]):
        decision, history = decide(policy, now=step * INTERVAL, current=current,
                                   pods=pods(current) if current else [],
                                   router_queued=queued, history=history)  # fmt: skip
        answers.append(decision.desired)
        current = decision.desired
    assert answers == [1, 1, 1, 0, 0, 1, 1]


def test_a_busy_or_demanded_role_never_goes_to_zero():
    policy = Policy(min_replicas=0, max_replicas=3, target_requests_waiting=2,
                    scale_to_zero_after_s=0)  # fmt: skip
    one_running = [PodMetrics("p0", 0, 1, 0.1)]
    decision, _ = decide(policy, now=0, current=1, pods=one_running, router_queued=0,
                         history=History())  # fmt: skip
    assert decision.desired == 1
    decision, _ = decide(policy, now=0, current=1, pods=pods(1), router_queued=2,
                         history=History())  # fmt: skip
    assert decision.desired == 1
    # Without a router to ask, a role at zero stays there (nothing can signal demand).
    decision, _ = decide(policy, now=0, current=0, pods=[], router_queued=None, history=History())
    assert (decision.desired, decision.reason) == (0, "scaled to zero, no queued demand")


def test_router_queue_gauge_is_read_per_role():
    text = (
        "# TYPE atom:router_queued_requests gauge\n"
        'atom:router_queued_requests{role="decode"} 2.0\n'
        'atom:router_queued_requests{role="prefill"} 0.0\n'
        "# TYPE atom:router_demand counter\n"
        'atom:router_demand_total{role="decode"} 7.0\n'
    )
    assert parse_router_queue(text) == {"decode": 2.0, "prefill": 0.0}
