"""CPU threads from the cores the process may use (system/threads.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from atom_runtime.system import threads
from atom_runtime.system.threads import CpuBudget, cgroup_cpu_quota, plan_threads


def _cgroup(tmp_path: Path, files: dict[str, str], membership: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(membership)
    return root, proc


def test_cgroup_v2_quota_is_the_tightest_on_the_path_to_the_root(tmp_path):
    root, proc = _cgroup(
        tmp_path,
        {
            "cpu.max": "max 100000\n",
            "pod/cpu.max": "300000 100000\n",
            "pod/ctr/cpu.max": "150000 100000\n",
        },  # fmt: skip
        "0::/pod/ctr\n",
    )
    assert cgroup_cpu_quota(root, proc) == 1.5
    assert CpuBudget(affinity=8, quota=1.5).cores == 2  # rounded up
    assert CpuBudget(affinity=2, quota=6.0).cores == 2  # the affinity mask is tighter


def test_cgroup_v1_quota_and_unlimited(tmp_path):
    root, proc = _cgroup(
        tmp_path,
        {
            "cpu,cpuacct/docker/cpu.cfs_quota_us": "400000\n",
            "cpu,cpuacct/docker/cpu.cfs_period_us": "100000\n",
        },  # fmt: skip
        "4:cpu,cpuacct:/docker\n",
    )
    assert cgroup_cpu_quota(root, proc) == 4.0
    root, proc = _cgroup(tmp_path / "u", {"cpu.max": "max 100000\n"}, "0::/\n")
    assert cgroup_cpu_quota(root, proc) is None
    assert cgroup_cpu_quota(tmp_path / "nothing", tmp_path / "no-file") is None


def test_plan_uses_the_usable_cores_and_splits_them():
    eight = CpuBudget(affinity=8, quota=None)
    assert plan_threads(None, budget=eight, environ={}).threads == 8
    # Serving from 4 cores: one for the API server; the rest split between the ranks.
    assert plan_threads(None, 1, serving=True, budget=eight, environ={}).threads == 7
    assert plan_threads(None, 2, serving=True, budget=eight, environ={}).threads == 3
    two = CpuBudget(affinity=2, quota=None)
    assert plan_threads(None, 1, serving=True, budget=two, environ={}).threads == 2
    assert plan_threads(None, 4, budget=two, environ={}).threads == 1  # never below one
    plan = plan_threads(None, 2, serving=True, budget=eight, environ={})
    assert "8 usable cores" in plan.describe() and "API server" in plan.describe()


def test_flag_then_omp_num_threads_override_the_plan():
    eight = CpuBudget(affinity=8, quota=None)
    assert plan_threads(3, budget=eight, environ={"OMP_NUM_THREADS": "5"}).threads == 3
    plan = plan_threads(None, 2, budget=eight, environ={"OMP_NUM_THREADS": "5"})
    assert (plan.threads, plan.source) == (5, "OMP_NUM_THREADS")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='x'"):
        plan_threads(None, budget=eight, environ={"OMP_NUM_THREADS": "x"})
    with pytest.raises(ValueError, match="cpu_threads: must be >= 1"):
        plan_threads(0, budget=eight, environ={})


def test_configure_sets_torch_threads_and_logs_once(monkeypatch, caplog):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_applied", None)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="atom_runtime.system.threads"):
            threads.configure_cpu_threads(1)
            threads.configure_cpu_threads(1)
            assert torch.get_num_threads() == 1
        lines = [r.getMessage() for r in caplog.records if "CPU threads" in r.getMessage()]
        assert lines == ["1 CPU threads per engine process (--cpu-threads); --cpu-threads or "
                         "OMP_NUM_THREADS to change"]  # fmt: skip
    finally:
        torch.set_num_threads(before)
