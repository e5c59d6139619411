"""Every entry of the CLI table answers --help (exit 0) and documents itself."""

from __future__ import annotations

import argparse

import pytest

from lmforge.cli import build_parser, main


def _commands() -> list[list[str]]:
    """All command paths in the parser: ["tokenizer"], ["tokenizer", "train"], ["train"], ..."""
    out: list[list[str]] = []

    def walk(parser: argparse.ArgumentParser, prefix: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out.append(prefix + [name])
                    walk(sub, prefix + [name])

    walk(build_parser(), [])
    return out


def test_tokenizer_commands_are_registered():
    cmds = {" ".join(c) for c in _commands()}
    assert {"tokenizer train", "tokenizer encode", "tokenizer decode", "tokenizer stats"} <= cmds


@pytest.mark.parametrize("cmd", [[]] + _commands(), ids=lambda c: " ".join(c) or "lmforge")
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lmforge") and len(out.splitlines()) >= 3


def test_unknown_command_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2
