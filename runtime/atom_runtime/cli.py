"""The `atom` command line: one entry point, one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are imported
only when their subcommand runs, so `atom render` never imports torch and `atom serve` never
imports kopf.

Every `--help` shows each flag's default and choices (`HelpFormatter`, inherited by
subcommands' own subparsers). A command that fails before it is up prints one line, `atom
<command>: error: ...`, and exits non-zero; the traceback only with `--log-level debug`.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.metadata
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("atom_runtime.server.cli", "start the OpenAI-compatible server"),
    "generate": ("atom_runtime.generate", "generate text offline for one or more prompts"),
    "bench": (
        "atom_runtime.bench.cli",
        "benchmarks: `atom bench throughput|latency|prefix|serve|multiturn|startup`",
    ),
    "router": ("atom_runtime.router.cli", "KV-cache-aware router in front of `atom serve` pods"),
    "kv-events": ("atom_runtime.kv_events.cli", "KV-cache event tools: `atom kv-events listen`"),
    "render": ("atom_operator.cli.render", "render an AtomDeployment's child objects as YAML"),
    "operator": ("atom_operator.cli.run", "run the Kubernetes operator: `atom operator run`"),
}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with every option's default appended, `(default: X)`, unless its help
    already says what the default is or there is none to show (None, a bare switch); an option
    with no help text gets the default alone (argparse would print nothing after it)."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings and _shown_default(action):
            action = copy.copy(action)
            action.help = f"(default: {_shown_default(action).replace('%', '%%')})"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or not action.option_strings or not _shown_default(action):
            return text
        shown = "on" if default is True else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def _shown_default(action: argparse.Action) -> str:
    """The default as --help shows it; "" when there is none worth showing."""
    default = action.default
    # Identity, not equality: a default of 0 is shown (0 == False).
    if default is None or default is False or default is argparse.SUPPRESS or default == "":
        return ""
    if isinstance(action, argparse._VersionAction):
        return ""
    return "on" if default is True else str(default)


class ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser with `HelpFormatter`; subparsers made from it are of this class too.
    A flag it refuses is one line, exit 2, pointing at --help (argparse's default prints the
    whole usage first: 50 lines for `atom serve`, the error last)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def package_version() -> str:
    """ATOM's version, from the installed package's metadata (importing `atom_runtime` itself
    would reach for the engine)."""
    try:
        return importlib.metadata.version("atom-serving")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _usage() -> str:
    lines = ["usage: atom <command> [options]", "       atom --version", "", "commands:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "`atom <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"atom {package_version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"atom: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = ArgumentParser(prog=f"atom {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"atom {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # The last resort for a failure no command turned into its own message: one line, and
        # the traceback only when asked for.
        if str(getattr(args, "log_level", "")).lower() == "debug":
            raise
        print(
            f"atom {name}: error: {type(e).__name__}: {e} (--log-level debug shows the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
