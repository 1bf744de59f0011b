"""The kubelet's `$(VAR)` expansion in container `command`, `args` and env `value`s.

The kubelet replaces `$(NAME)` with the value of the container's variable NAME before the process
starts, and `$$` with a literal `$`. A user string placed there unescaped can therefore read
any variable of the container (one backed by a Secret included) into the served model name, a
flag or a log line. Every user string the operator puts in args or env values goes through
`literal`; the operator's own references are written with `reference`, so the two never mix.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def literal(text: str) -> str:
    """`text` such that the kubelet passes it through unchanged: every `$` doubled."""
    return text.replace("$", "$$")


def reference(variable: str) -> str:
    """`$(variable)`, which the kubelet expands to the container's variable of that name."""
    if not _NAME.fullmatch(variable):
        raise ValueError(f"not an environment variable name: {variable!r}")
    return f"$({variable})"


def _scan(text: str) -> list[tuple[str, str]]:
    """`text` as the kubelet reads it: ("text", s) runs and ("ref", NAME) references. As in
    Kubernetes' expansion: `$$` is one `$`, `$(NAME)` a reference (NAME being anything up to
    the next `)`), any other `$` is kept."""
    parts: list[tuple[str, str]] = []
    index = 0
    while index < len(text):
        if text.startswith("$$", index):
            parts.append(("text", "$"))
            index += 2
        elif text.startswith("$(", index) and text.find(")", index + 2) != -1:
            end = text.find(")", index + 2)
            parts.append(("ref", text[index + 2 : end]))
            index = end + 1
        else:
            parts.append(("text", text[index]))
            index += 1
    return parts


def references(text: str) -> list[str]:
    """The variables the kubelet would expand in `text`, in order (`$$(X)` is a literal)."""
    return [value for kind, value in _scan(text) if kind == "ref"]


def expand(text: str, variables: dict[str, str]) -> str:
    """What the kubelet makes of `text` for a container with `variables` (a reference to a
    variable the container does not have stays as written, as the kubelet leaves it)."""
    return "".join(
        value if kind == "text" else variables.get(value, f"$({value})")
        for kind, value in _scan(text)
    )
