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


def test_top_level_help_loads_no_command_module():
    """`lmforge --help` lists every command without importing one (nor torch): it stays instant."""
    import subprocess
    import sys

    code = ("import sys\nfrom lmforge.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "loaded = [m for m in sys.modules if m == 'torch' or m.startswith(('lmforge.cli.', 'lmforge.tokenizer'))]\n"
            "assert not loaded, loaded\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "speedrun" in out.stdout and "tokenizer" in out.stdout


def test_python_dash_m_runs_the_cli():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lmforge.cli", "data", "get", "nosuch"], capture_output=True, text=True)
    assert out.returncode == 2 and "invalid choice: 'nosuch'" in out.stderr


def test_a_command_line_builds_only_its_own_parsers():
    """main() builds the parsers on the path of the command it runs (the others cost ~5 ms to build), and
    they parse that command line exactly as the full table does."""
    argv = ["-q", "tokenizer", "train", "--input", "a.txt", "--vocab-size", "300", "--out", "o.json", "--force"]
    lean = build_parser(only="tokenizer", sub="train")
    (top,) = [a for a in lean._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(top.choices) == ["tokenizer"]
    (group,) = [a for a in top.choices["tokenizer"]._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(group.choices) == ["train"]
    assert vars(lean.parse_args(argv)) == vars(build_parser().parse_args(argv))
    unknown = build_parser(only="tokenizer", sub="nosuch")  # an unknown subcommand: the group lists all of its own
    (top,) = [a for a in unknown._actions if isinstance(a, argparse._SubParsersAction)]
    (group,) = [a for a in top.choices["tokenizer"]._actions if isinstance(a, argparse._SubParsersAction)]
    assert {"train", "encode", "decode", "stats"} <= set(group.choices)
