"""`atom render -f FILE`: print the objects an AtomDeployment becomes, like `helm template`.

Reads one or more YAML documents (`-f -` reads stdin), renders every AtomDeployment among them
with the same pure functions the operator uses, and writes the children as multi-document YAML,
each deployment's keys Secret first (fresh random keys; `--no-keys-secret` leaves it out).
No cluster is contacted. Bad input (a file that cannot be read, YAML that does not parse, a
document that is not an AtomDeployment, an invalid spec) prints one line naming the file and the
problem, `atom render: error: FILE: ...` (`<stdin>` for `-f -`), and exits 2, writing no YAML.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from atom_operator.operator_config import (
    DEFAULT_CONFIG,
    OperatorConfig,
    add_config_arguments,
    config_from_args,
)
from atom_operator.render import render_children
from atom_operator.render.keys import DeploymentKeys
from atom_operator.schema import API_VERSION, KIND
from atom_operator.spec import SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f",
        "--filename",
        required=True,
        help="YAML file with one or more AtomDeployment documents; `-` reads stdin",
    )
    parser.add_argument(
        "-n",
        "--namespace",
        default="default",
        help="namespace for documents that name none (default: %(default)s)",
    )
    parser.add_argument(
        "--no-keys-secret",
        action="store_true",
        help="leave out the <name>-atom-keys Secret (its keys are generated afresh on every "
        "render: create it once, then re-render without it so running pods keep their keys)",
    )
    add_config_arguments(parser)


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def render_documents(
    text: str,
    namespace: str,
    config: OperatorConfig = DEFAULT_CONFIG,
    *,
    with_keys: bool = True,
) -> list[dict[str, Any]]:
    """Every child of every AtomDeployment in a YAML stream (raises SpecError, ValueError);
    `with_keys`: each one's keys Secret too, with freshly generated keys."""
    children: list[dict[str, Any]] = []
    documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    if not documents:
        raise ValueError("no YAML documents found")
    for index, doc in enumerate(documents):
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"document {index + 1} is a {kind}, not an {KIND}")
        if doc.get("apiVersion") != API_VERSION:
            raise SpecError("apiVersion", f"must be {API_VERSION}, got {doc.get('apiVersion')!r}")
        body = dict(doc)
        metadata = dict(body.get("metadata") or {})
        metadata.setdefault("namespace", namespace)
        body["metadata"] = metadata
        keys = DeploymentKeys.generate() if with_keys else None
        try:
            children += render_children(body, config, keys)
        except SpecError as error:
            if len(documents) == 1:
                raise
            # Which of several documents: its place in the stream and its name.
            name = metadata.get("name", "unnamed")
            raise SpecError(
                f"document {index + 1} ({name}): {error.field}", error.message
            ) from None
    return children


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML parse error in one line: where (line and column, 1-based) and what, without
    PyYAML's multi-line excerpt, which names the source as "<unicode string>"."""
    if not isinstance(error, yaml.MarkedYAMLError):
        return " ".join(str(error).split())
    mark = error.problem_mark or error.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    what = error.problem or "invalid YAML"
    context = f" ({error.context})" if error.context else ""
    return f"{where}invalid YAML: {what}{context}"


def run(args: argparse.Namespace) -> int:
    source = "<stdin>" if args.filename == "-" else args.filename
    try:
        children = render_documents(
            _read(args.filename),
            args.namespace,
            config_from_args(args),
            with_keys=not args.no_keys_secret,
        )
    except yaml.YAMLError as error:
        problem = yaml_problem(error)
    except OSError as error:
        problem = f"cannot read it: {error.strerror or error}"
    except (SpecError, ValueError) as error:  # SpecError's text starts with the field
        problem = " ".join(str(error).split())
    else:
        sys.stdout.write(yaml.safe_dump_all(children, sort_keys=False, explicit_start=True))
        return 0
    print(f"atom render: error: {source}: {problem}", file=sys.stderr)
    return 2
