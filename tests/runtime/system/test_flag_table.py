"""system/flag_table.py: a row's default and type come from its config field; extras win."""

import argparse
from dataclasses import dataclass

import pytest

from atom_runtime.system.flag_table import add_flags, add_number_flags, flag_arguments, same_named


@dataclass
class _Defaults:
    rate: float = 2.5
    count: int = 3
    name: str = "auto"
    switch: bool = True
    maybe: int | None = None


def test_field_gives_default_and_type():
    d = _Defaults()
    assert flag_arguments(d, ("--rate", "rate", "how fast")) == (
        ["--rate"],
        {"default": 2.5, "type": float, "help": "how fast"},
    )
    assert flag_arguments(d, ("--count -c", "count", None)) == (
        ["--count", "-c"],
        {"default": 3, "type": int},
    )
    assert flag_arguments(d, ("--name", "name", None)) == (["--name"], {"default": "auto"})
    assert flag_arguments(d, ("--switch", "switch", "on or off")) == (
        ["--switch"],
        {"default": True, "action": argparse.BooleanOptionalAction, "help": "on or off"},
    )


def test_extra_keywords_win_and_no_field_sets_no_default():
    d = _Defaults()
    names, kwargs = flag_arguments(d, ("--maybe", "maybe", "x", {"type": int}))
    assert kwargs == {"default": None, "type": int, "help": "x"}
    names, kwargs = flag_arguments(d, ("--flag", None, "y", {"action": "store_true"}))
    assert (names, kwargs) == (["--flag"], {"help": "y", "action": "store_true"})


def test_add_flags_parses_in_one_group():
    parser = argparse.ArgumentParser()
    group = add_flags(parser, "things", _Defaults(), (
        ("--rate", "rate", None),
        ("--count -c", "count", None),
        ("--switch", "switch", None),
        ("--flag", None, None, {"action": "store_true"}),
    ))  # fmt: skip
    assert group.title == "things"
    assert [a.dest for a in group._group_actions] == ["rate", "count", "switch", "flag"]
    args = parser.parse_args(["-c", "7", "--no-switch", "--flag"])
    assert (args.rate, args.count, args.switch, args.flag) == (2.5, 7, False, True)
    assert same_named(args, "rate count") == {"rate": 2.5, "count": 7}


def test_a_malformed_row_is_refused_by_name():
    with pytest.raises(ValueError, match="a flag row is"):
        flag_arguments(_Defaults(), ("--rate", "rate"))
    with pytest.raises(AttributeError):
        flag_arguments(_Defaults(), ("--nope", "nope", None))


def test_number_flags_take_their_type_from_the_default():
    parser = argparse.ArgumentParser()
    add_number_flags(parser, num_prompts=256, range_ratio=0.0)
    assert [a.option_strings for a in parser._actions[1:]] == [["--num-prompts"], ["--range-ratio"]]
    args = parser.parse_args(["--num-prompts", "7", "--range-ratio", "0.5"])
    assert (args.num_prompts, args.range_ratio) == (7, 0.5)
    assert parser.parse_args([]).num_prompts == 256
    with pytest.raises(SystemExit):
        parser.parse_args(["--num-prompts", "1.5"])
    with pytest.raises(TypeError, match="--peer-cache: a number flag's default"):
        add_number_flags(parser, peer_cache="auto")
