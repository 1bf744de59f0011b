"""`atom operator run`: run the AtomDeployment operator (kopf) in this process.

    atom operator run                          # every namespace (cluster-wide)
    atom operator run -n team-a -n team-b      # only these namespaces
    atom operator run --standalone --liveness http://0.0.0.0:8080/healthz

The same operator runs with kopf's own command line: `kopf run -m atom_operator.handlers`
(importing `atom_operator` alone registers nothing; the handlers live in that module).
`python -m atom_operator` is `atom operator`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import kopf

from atom_operator.operator_config import add_config_arguments, config_from_args
from atom_runtime.system.process import LOG_LEVELS, log_level

PROCESS_ROLE = "Operator"  # the process title: ATOM::Operator


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    run = actions.add_parser("run", help="watch AtomDeployments and reconcile their children")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="serve AtomDeployments of this namespace (repeatable; a glob like team-* works)",
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="serve every namespace (the default when no --namespace is given)",
    )
    run.add_argument(
        "--standalone",
        action="store_true",
        help="do not coordinate with other operator replicas through kopf's peering objects",
    )
    run.add_argument(
        "--liveness",
        metavar="URL",
        help="serve a liveness probe at this URL, e.g. http://0.0.0.0:8080/healthz",
    )
    run.add_argument(  # every `atom` command's log-level convention: lower case shown, any case read
        "--log-level",
        choices=LOG_LEVELS,
        type=log_level,
        default="info",
        help="log level, any case",
    )
    run.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG (kopf's too)")
    run.add_argument(
        "--no-cluster-scan",
        action="store_true",
        help="need no cluster-scoped permission: do not watch CustomResourceDefinitions or "
        "namespaces (give --namespace with plain names; the Helm chart's `namespaced: true`)",
    )
    add_config_arguments(run)


def operator_options(args: argparse.Namespace) -> dict[str, object]:
    """The keyword arguments `kopf.run` gets for these command-line arguments; the memo carries
    the operator's configuration to the handlers (`handlers.configure`)."""
    namespaces = list(args.namespace or [])
    if args.no_cluster_scan and (not namespaces or any("*" in ns for ns in namespaces)):
        raise ValueError("--no-cluster-scan needs --namespace with plain namespace names")
    return {
        "standalone": bool(args.standalone),
        "clusterwide": not namespaces,
        "namespaces": namespaces,
        "liveness_endpoint": args.liveness,
        "memo": kopf.Memo(config=config_from_args(args), cluster_scan=not args.no_cluster_scan),
    }


def run(args: argparse.Namespace) -> int:
    if args.action != "run":  # argparse allows only `run`; keep the dispatch explicit
        raise ValueError(f"atom operator: unknown action {args.action!r}")
    try:
        options = operator_options(args)
    except ValueError as error:
        print(f"atom operator run: {error}", file=sys.stderr)
        return 2

    from atom_runtime.system.process import apply_gc_policy, release_gc_policy, set_process_title

    set_process_title(PROCESS_ROLE)
    level = "DEBUG" if args.verbose else args.log_level.upper()
    kopf.configure(
        debug=level == "DEBUG",
        verbose=args.verbose,
        quiet=level in ("WARNING", "ERROR", "CRITICAL"),
    )
    logging.getLogger().setLevel(level)
    importlib.import_module("atom_operator.handlers")  # registers the handlers with kopf

    # Design contract 7: everything imported so far lives as long as the process, so collect
    # once and freeze it before serving; unfreeze on the way out.
    apply_gc_policy()
    try:
        kopf.run(registry=kopf.get_default_registry(), **options)
    finally:
        release_gc_policy()
    return 0
