"""Shared test configuration: GPU-only tests skip with a reason when no GPU is present, and no
process a test (or a fixture) starts may outlive it."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Folders of small random models by kind: llama, llama3, qwen2, qwen3 (built once)."""
    from tests.model_factory import CONFIGS, make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {kind: make_tiny_model(root / kind, kind) for kind in CONFIGS}


@pytest.fixture(scope="session")
def tiny_hybrid_models(tmp_path_factory):
    """Folders of small random hybrid models: qwen3_5, qwen3_5_moe, qwen3_next (built once)."""
    from tests.model_factory import HYBRID_CONFIGS, make_tiny_model

    root = tmp_path_factory.mktemp("hybrid_models")
    return {kind: make_tiny_model(root / kind, kind) for kind in HYBRID_CONFIGS}


@pytest.fixture(scope="session")
def tiny_mla_models(tmp_path_factory):
    """Folders of small random DeepSeek models: deepseek_v3, deepseek_v2 (built once)."""
    from tests.model_factory import MLA_CONFIGS, make_tiny_model

    root = tmp_path_factory.mktemp("mla_models")
    return {kind: make_tiny_model(root / kind, kind) for kind in MLA_CONFIGS}


@pytest.fixture
def no_leftover_tp_workers():
    """Every tensor-parallel worker a test starts is gone when it ends, and the process group
    with it (rank 0 lives in the test process)."""
    import multiprocessing

    from atom_runtime.system import distributed

    before = set(multiprocessing.active_children())
    yield
    assert set(multiprocessing.active_children()) - before == set()
    assert distributed.tp_size() == 1


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory):
    """Folders of small random sparse-MoE models: qwen3_moe, mixtral, gpt_oss (built once)."""
    from tests.model_factory import MOE_CONFIGS, make_tiny_model

    root = tmp_path_factory.mktemp("moe_models")
    return {kind: make_tiny_model(root / kind, kind) for kind in MOE_CONFIGS}


# -- no leaked processes -----------------------------------------------------------------------

# Helpers Python and torch start once and keep for the whole session, by design.
SESSION_HELPERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "torch/_inductor/compile_worker",
)
# A process its owner has just stopped may need a moment to be reaped; one still alive after
# this is a leak. (Not a correctness window: a leak stays forever.)
EXIT_GRACE_S = 10.0


def _child_pids(pid: int) -> list[int]:
    """Direct children, from /proc/<pid>/task/*/children (cheap) or psutil's scan."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        return [
            int(child)
            for task in tasks.iterdir()
            for child in (task / "children").read_text().split()
        ]
    except OSError:  # not Linux, or a kernel without CONFIG_PROC_CHILDREN
        try:
            return [p.pid for p in psutil.Process(pid).children()]
        except psutil.Error:
            return []


def live_descendants() -> dict[tuple[int, float], psutil.Process]:
    """This process's descendants that are running, keyed by (pid, start time) so a reused pid
    is a new process; zombies and SESSION_HELPERS left out."""
    out = {}
    stack = [os.getpid()]
    while stack:
        for pid in _child_pids(stack.pop()):
            stack.append(pid)
            try:
                proc = psutil.Process(pid)
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmdline = " ".join(proc.cmdline())
                key = (pid, proc.create_time())
            except psutil.Error:
                continue
            if not any(helper in cmdline for helper in SESSION_HELPERS):
                out[key] = proc
    return out


# A process's start time as psutil reports it moves when the kernel's idea of the boot time does
# (/proc/stat's btime is the wall clock minus the uptime, so a clock adjustment shifts it by a
# second): a process whose pid was there before, started within this much of then, is the same.
SAME_START_S = 2.0


def _fail_if_new_processes(before: dict, where: str) -> None:
    started = {pid: t for pid, t in before}
    new = [
        p
        for (pid, t), p in live_descendants().items()
        if pid not in started or abs(t - started[pid]) > SAME_START_S
    ]
    if not new:
        return
    _, alive = psutil.wait_procs(new, timeout=EXIT_GRACE_S)
    if not alive:
        return
    described = []
    for proc in alive:
        try:
            described.append(f"pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
            proc.kill()  # so it does not keep eating the machine for the rest of the run
        except psutil.Error:
            pass
    if described:
        pytest.fail(
            f"{len(described)} process(es) started by {where} outlived it (killed now); stop "
            "every process in a fixture teardown:\n  " + "\n  ".join(described),
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test(request):
    before = live_descendants()
    yield
    _fail_if_new_processes(before, f"test {request.node.nodeid}")


@pytest.fixture(autouse=True, scope="module")
def _no_process_outlives_its_module(request):
    before = live_descendants()
    yield
    _fail_if_new_processes(before, f"a fixture of {request.node.nodeid}")


@pytest.fixture(autouse=True, scope="session")
def _no_process_outlives_the_session():
    before = live_descendants()
    yield
    _fail_if_new_processes(before, "a session fixture")
