"""The NIXL Python API, from whichever wheel is installed: `nixl_cu12` (pip `nixl-cu12`),
`nixl_cu13` (pip `nixl-cu13`) or the `nixl` meta package that picks one of them. The wheel built
for torch's CUDA major goes first (a cu13 wheel beside a cu12 torch would load a second CUDA
runtime); on a CPU-only machine any of them runs DRAM to DRAM.

`pip install "atom-serving[nixl]"` names nixl-cu12; it declares a `torch` dependency, so on a
CPU-only machine install it with `--no-deps` (numpy is its one other dependency) to keep the CPU
torch build. On a CUDA 13 machine install nixl-cu13 instead.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

PIP_NAMES = {"nixl_cu12": "nixl-cu12==1.5.1", "nixl_cu13": "nixl-cu13==1.5.1", "nixl": "nixl"}


def candidates() -> list[str]:
    """Module names to try, best first."""
    import torch

    order = ["nixl_cu12", "nixl_cu13", "nixl"]
    cuda = getattr(torch.version, "cuda", None)
    if cuda:
        mine = f"nixl_cu{cuda.split('.')[0]}"
        order = [mine, *[m for m in order if m != mine]]
    return order


def load_nixl() -> SimpleNamespace:
    """`nixl_agent`, `nixl_agent_config` and the module's name; ImportError naming the pip
    packages when none is installed."""
    tried = []
    for name in candidates():
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError as e:
            if e.name not in (name, f"{name}._api"):
                tried.append(f"{name} ({e})")  # present but broken: say why
            else:
                tried.append(name)
            continue
        return SimpleNamespace(
            name=name, nixl_agent=api.nixl_agent, nixl_agent_config=api.nixl_agent_config
        )
    raise ImportError(
        "kv_transfer_config.kv_connector: NixlConnector needs the NIXL Python package and none "
        f"could be imported (tried {', '.join(tried)}): pip install {PIP_NAMES['nixl_cu12']} "
        f"(CUDA 12) or {PIP_NAMES['nixl_cu13']} (CUDA 13), with --no-deps on a CPU-only machine "
        "(it declares a torch dependency); or use AtomPortableConnector, which needs nothing"
    )
