"""Contract 7 (docs/architecture.md): process titles from one naming function; collect + freeze
after warm-up, unfreeze at shutdown, ATOM_GC_FREEZE=0 thresholds, ATOM_GC_DEBUG=1 logging; and an
engine torn down inside a live interpreter gives its memory back.

Policy tests run in fresh interpreters: freezing pytest's own heap would leak into other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from atom_runtime.system.process import TUNED_THRESHOLDS, process_title


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, title",
    [
        (("APIServer",), "ATOM::APIServer"),
        (("EngineCore",), "ATOM::EngineCore"),
        (("EngineCore", 2), "ATOM::EngineCore_DP2"),
        (("Worker", 0, 1), "ATOM::DP0TP1"),
        (("Worker", 3, 0), "ATOM::DP3TP0"),
        (("Worker", None, 5), "ATOM::DP0TP5"),
    ],
)
def test_process_title_names(args, title):
    assert process_title(*args) == title


@pytest.mark.parametrize(
    "args, field",
    [
        (("engine core",), "role"),
        (("apiServer",), "role"),
        (("Worker", -1, 0), "dp_rank"),
        (("Worker", 0, True), "tp_rank"),
    ],
)
def test_process_title_rejects_bad_input(args, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        process_title(*args)


def test_set_process_title_sets_the_os_title():
    r = run_python(
        """
        import multiprocessing, setproctitle
        from atom_runtime.system.process import set_process_title
        print(set_process_title("Worker", 1, 2))
        print(setproctitle.getproctitle(), multiprocessing.current_process().name)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["ATOM::DP1TP2", "ATOM::DP1TP2 DP1TP2"]


POLICY_ROUNDTRIP = """
    import gc, json
    from atom_runtime.system.process import apply_gc_policy, release_gc_policy
    default = gc.get_threshold()
    junk = [[i] for i in range(10_000)]
    policy = apply_gc_policy()
    during = {"freeze_count": gc.get_freeze_count(), "threshold": gc.get_threshold()}
    release_gc_policy()
    print(json.dumps({
        "policy": policy.__dict__, "during": during, "default": default,
        "after": {"freeze_count": gc.get_freeze_count(), "threshold": gc.get_threshold()},
    }))
"""


def test_apply_freezes_after_collecting_and_release_unfreezes():
    r = run_python(POLICY_ROUNDTRIP)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["policy"]["frozen"] is True
    assert out["policy"]["frozen_objects"] == out["during"]["freeze_count"] > 10_000
    assert out["during"]["threshold"] == out["default"]
    assert out["after"] == {"freeze_count": 0, "threshold": out["default"]}


def test_freeze_off_falls_back_to_tuned_thresholds():
    r = run_python(POLICY_ROUNDTRIP, env={"ATOM_GC_FREEZE": "0"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["policy"]["frozen"] is False
    assert out["during"] == {"freeze_count": 0, "threshold": list(TUNED_THRESHOLDS)}
    assert out["after"]["threshold"] == out["default"]


def test_gc_debug_logs_each_collection_until_release():
    r = run_python(
        """
        import gc, logging
        logging.basicConfig(level="INFO", format="%(name)s %(message)s")
        from atom_runtime.system.process import apply_gc_policy, release_gc_policy
        apply_gc_policy()
        for _ in range(3):
            a = []; a.append(a); del a   # one unreachable cycle per collection
            gc.collect(0)
        release_gc_policy()
        gc.collect(0)
        """,
        env={"ATOM_GC_DEBUG": "1"},
    )
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("atom_runtime.gc gc: ")]
    # apply's own full collection, three generation-0 ones, release's full collection.
    assert [x.split()[3] for x in lines] == ["2", "0", "0", "0", "2"]
    assert all(" ms, reclaimed " in x for x in lines)
    assert "reclaimed 1 objects" in lines[1]


def test_bad_policy_env_value_is_refused():
    r = run_python(
        "from atom_runtime.system.process import apply_gc_policy; apply_gc_policy()",
        env={"ATOM_GC_FREEZE": "yes"},
    )
    assert r.returncode == 1
    assert "ValueError: ATOM_GC_FREEZE: must be 0 or 1, got 'yes'" in r.stderr


ENGINE_TEARDOWN = """
    import gc, json, os, sys, weakref
    from atom_runtime.config import EngineConfig
    from atom_runtime.engine.core import EngineCore
    from atom_runtime.system.process import apply_gc_policy, release_gc_policy

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    engine = EngineCore(EngineConfig(model=sys.argv[1], dtype="float32", device="cpu",
                                     num_gpu_blocks_override=4096))
    cache = 0
    for layer in engine.executor.model.attention_layers():
        layer.k_cache.fill_(1.0)   # torch.empty pages are not resident until written
        layer.v_cache.fill_(1.0)
        cache += layer.k_cache.nbytes + layer.v_cache.nbytes
    params = sum(p.nbytes for p in engine.executor.model.parameters())
    apply_gc_policy()   # warm-up done: freeze, as every long-lived process does
    before = rss()
    alive = weakref.ref(engine)
    weights = weakref.ref(next(engine.executor.model.parameters()))
    engine.shutdown()
    del engine
    gc.collect()
    frozen = {"engine_alive": alive() is not None, "weights_alive": weights() is not None,
              "freed": before - rss()}
    release_gc_policy()
    print(json.dumps({
        "cache": cache, "params": params, "while_frozen": frozen,
        "engine_alive": alive() is not None, "weights_alive": weights() is not None,
        "freed": before - rss(),
    }))
"""


def test_engine_destroyed_in_one_interpreter_releases_its_memory(tiny_models):
    """What is measured: the process RSS (/proc/self/statm) around tearing down an EngineCore
    whose KV cache (32 MiB of CPU tensors, written so its pages are resident) and weights
    (~24 MiB) are live, plus weak references to the engine and its first weight tensor.

    What it shows: EngineCore.shutdown() frees the KV cache at once, and dropping the engine
    frees the EngineCore object, but the weights sit in reference cycles that a frozen
    heap never collects: the weights stay resident until release_gc_policy() unfreezes. After
    it, cache and weights are both given back to the OS."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ENGINE_TEARDOWN), str(tiny_models["llama"])],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cache, params = out["cache"], out["params"]
    assert cache == 32 * 2**20  # 4096 blocks x 8 KiB (K and V, 2 layers)
    assert params > 20 * 2**20
    frozen = out["while_frozen"]
    assert frozen["engine_alive"] is False
    assert frozen["weights_alive"] is True  # held by frozen cycles
    assert 0.9 * cache <= frozen["freed"] < cache + 0.5 * params
    assert out["engine_alive"] is False and out["weights_alive"] is False
    assert out["freed"] >= 0.9 * (cache + params)
