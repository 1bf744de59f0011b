"""How many CPU threads each engine process runs its tensor ops on, chosen from the cores this
process may use, not from the machine's core count.

Torch's default is one intra-op thread per core of the machine (`os.cpu_count()`), whatever the
process is allowed: in a container limited to 2 CPUs on a 64-core host, or beside other busy
processes, its OpenMP threads then outnumber the cores they get and wait on each other at every
barrier: the default model decoded at 1.3 tokens/s that way on a shared 2-core machine, and at
16 with one thread. So the engine counts the cores it may run on (the CPU affinity mask, then
the cgroup's CPU quota, rounded up) and splits them:

- the API server (`atom serve`) keeps one: it tokenizes, detokenizes and writes streams, and
  an OpenMP thread it preempts stalls the whole step; on machines of fewer than 4 usable cores
  it gets none of its own (its work per step is a fraction of a decode step's there);
- the rest go to the engine, split evenly between its tensor-parallel ranks on CPU.

`--cpu-threads N` (each engine process) or OMP_NUM_THREADS (the usual variable) overrides it.
The choice is logged once per process.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Usable cores from which the API server keeps one core for itself.
API_SERVER_CORE_FROM = 4


@dataclass(frozen=True)
class CpuBudget:
    """The cores this process may use: its affinity mask, capped by its cgroup's CPU quota."""

    affinity: int
    quota: float | None  # cores' worth of CPU time the cgroup allows; None: no limit

    @property
    def cores(self) -> int:
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, math.ceil(self.quota)))

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup quota {self.quota:g}"
        return f"{self.cores} usable cores (affinity {self.affinity}, {quota})"


@dataclass(frozen=True)
class ThreadPlan:
    threads: int  # intra-op threads of each engine process (each tensor-parallel rank)
    source: str  # "--cpu-threads", "OMP_NUM_THREADS" or the budget it was derived from
    budget: CpuBudget

    def describe(self) -> str:
        return f"{self.threads} CPU threads per engine process ({self.source})"


def cpu_budget(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
) -> CpuBudget:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count() or 1
    return CpuBudget(affinity, cgroup_cpu_quota(root, proc_cgroup))


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")):
    """The tightest CPU quota (in cores) on this process's cgroup and its ancestors, cgroup v2
    (`cpu.max`: "<quota> <period>" or "max <period>") or v1 (`cpu.cfs_quota_us` /
    `cpu.cfs_period_us`, -1 unlimited); None when there is none or nothing can be read."""
    quotas = [q for d in _cgroup_dirs(root, proc_cgroup) if (q := _quota_in(d)) is not None]
    return min(quotas) if quotas else None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's cgroup folders and their ancestors, the root included (inside a cgroup
    namespace the process's own cgroup is the root)."""
    dirs = [root, root / "cpu", root / "cpu,cpuacct"]
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return dirs
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers not in ("", "cpu", "cpu,cpuacct", "cpuacct,cpu"):
            continue
        base = (
            root if controllers == "" else root / controllers.replace("cpuacct,cpu", "cpu,cpuacct")
        )
        here = base / path.lstrip("/")
        while here != base and base in here.parents:
            dirs.append(here)
            here = here.parent
    return dirs


def _quota_in(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def plan_threads(
    requested: int | None,
    tensor_parallel_size: int = 1,
    serving: bool = False,
    budget: CpuBudget | None = None,
    environ: dict | None = None,
) -> ThreadPlan:
    """The intra-op threads of each engine process: `requested` (--cpu-threads), else
    OMP_NUM_THREADS, else the usable cores less the API server's (serving, >= 4 cores), split
    between the tensor-parallel ranks, at least 1."""
    budget = budget or cpu_budget()
    environ = os.environ if environ is None else environ
    if requested is not None:
        if requested < 1:
            raise ValueError(f"cpu_threads: must be >= 1, got {requested}")
        return ThreadPlan(requested, "--cpu-threads", budget)
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp:
        try:
            threads = int(omp)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"OMP_NUM_THREADS={omp!r}: expected a positive integer")
        return ThreadPlan(threads, "OMP_NUM_THREADS", budget)
    cores = budget.cores
    reserved = 1 if serving and cores >= API_SERVER_CORE_FROM else 0
    threads = max(1, (cores - reserved) // max(1, tensor_parallel_size))
    split = f", {reserved} kept for the API server" if reserved else ""
    ranks = f", split over {tensor_parallel_size} ranks" if tensor_parallel_size > 1 else ""
    return ThreadPlan(threads, f"{budget.describe()}{split}{ranks}", budget)


_applied: ThreadPlan | None = None
_serving = False


def mark_serving() -> None:
    """This process is `atom serve`'s engine core: the API server beside it keeps a core."""
    global _serving
    _serving = True


def configure_cpu_threads(requested: int | None, tensor_parallel_size: int = 1) -> ThreadPlan:
    """Plan this process's intra-op threads (`plan_threads`) and set them in torch; logged once
    per process (again only if a later engine in the same process changes them)."""
    global _applied
    import torch

    plan = plan_threads(requested, tensor_parallel_size, _serving)
    torch.set_num_threads(plan.threads)
    if _applied is None or _applied.threads != plan.threads:
        log.info("%s; --cpu-threads or OMP_NUM_THREADS to change", plan.describe())
    _applied = plan
    return plan
