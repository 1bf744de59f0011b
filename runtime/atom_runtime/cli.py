"""The `atom` command line: one entry point, one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are imported
only when their subcommand runs, so `atom render` never imports torch and `atom serve` never
imports kopf.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("atom_runtime.server.cli", "start the OpenAI-compatible server"),
    "generate": ("atom_runtime.generate", "generate text offline for one or more prompts"),
    "bench": (
        "atom_runtime.bench.cli",
        "benchmarks: `atom bench throughput|latency|prefix|serve|multiturn`",
    ),
    "router": ("atom_runtime.router.cli", "KV-cache-aware router in front of `atom serve` pods"),
    "kv-events": ("atom_runtime.kv_events.cli", "KV-cache event tools: `atom kv-events listen`"),
    "render": ("atom_operator.cli.render", "render an AtomDeployment's child objects as YAML"),
    "operator": ("atom_operator.cli.run", "run the Kubernetes operator: `atom operator run`"),
}


def _usage() -> str:
    lines = ["usage: atom <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "`atom <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"atom: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"atom {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
