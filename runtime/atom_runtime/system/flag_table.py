"""Command-line flags from a table, one row a flag, where its default (and so its type) is the
config field it sets: the flag groups of the engine (engine_args.py) and of `atom router` list
their flags instead of repeating an `add_argument` call for each.

A row is `(names, field, help)` or `(names, field, help, extra)`:
- `names`: the option strings, space-separated ("--tensor-parallel-size -tp");
- `field`: the attribute of the defaults object that gives `default=` (None: no default from it);
  a bool field makes the flag `--x/--no-x` (BooleanOptionalAction), an int or float field gives
  `type=`;
- `help`: the help text (None: none);
- `extra`: more `add_argument` keywords (type, choices, action, metavar, nargs, default), which
  win over what `field` implied."""

from __future__ import annotations

import argparse
from typing import Any

FlagRow = tuple[Any, ...]


def flag_arguments(defaults: object, row: FlagRow) -> tuple[list[str], dict[str, Any]]:
    """The option strings and `add_argument` keywords of one row."""
    if len(row) not in (3, 4):
        raise ValueError(f"a flag row is (names, field, help[, extra]), got {row!r}")
    names, field, help_text = row[:3]
    kwargs: dict[str, Any] = {}
    if field is not None:
        value = getattr(defaults, field)
        kwargs["default"] = value
        if isinstance(value, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif type(value) in (int, float):
            kwargs["type"] = type(value)
    if help_text is not None:
        kwargs["help"] = help_text
    kwargs.update(row[3] if len(row) == 4 else {})
    return names.split(), kwargs


def add_flags(
    parser: argparse.ArgumentParser, title: str, defaults: object, rows: tuple[FlagRow, ...]
) -> argparse._ArgumentGroup:
    """Adds the argument group `title` with one flag a row, in the rows' order."""
    group = parser.add_argument_group(title)
    for row in rows:
        names, kwargs = flag_arguments(defaults, row)
        group.add_argument(*names, **kwargs)
    return group


def same_named(args: argparse.Namespace, names: str) -> dict[str, Any]:
    """The parsed values of the flags whose dest is the config field's name (space-separated
    `names`), as keywords for the config's constructor."""
    return {name: getattr(args, name) for name in names.split()}


def add_number_flags(parser: argparse.ArgumentParser, **defaults: float) -> None:
    """Numeric flags with no help text, in the keywords' order: `num_prompts=256` is
    `--num-prompts`, an int (a float default makes a float flag)."""
    for name, value in defaults.items():
        if type(value) not in (int, float):
            raise TypeError(f"--{name.replace('_', '-')}: a number flag's default must be an int "
                            f"or a float, got {value!r}")  # fmt: skip
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
