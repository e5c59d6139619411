"""docs/reference/ is generated from the code (tools/gen_reference.py): the committed files must equal what the
script writes now, every config key and flag must carry its help, and the generator must see what it claims to."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gen_reference  # noqa: E402


def test_committed_reference_matches_the_code():
    stale = [str(p.relative_to(ROOT)) for p in gen_reference.stale()]
    assert not stale, f"{stale} differ from the code: run `python tools/gen_reference.py` (make reference) and commit"


def test_every_config_key_and_flag_has_help():
    assert gen_reference.undocumented_keys() == [], "give each config field a docstring (the string under it)"
    assert gen_reference.undocumented_flags() == [], "give each flag a help= text"


@dataclasses.dataclass
class _Inner:
    """An inner section."""

    depth: int = 3
    """How deep."""
    names: list[str] = dataclasses.field(default_factory=lambda: ["a", "b"])
    """Which ``names`` (see :class:`~lmforge.x.Thing`)."""


@dataclasses.dataclass
class _Outer:
    inner: _Inner
    flag: bool = False
    """A ``flag``."""
    extra: float | None = None
    rate: str = "x|y"
    """A pipe | in the text."""


def test_config_rows_walk_sections_defaults_and_docstrings():
    rows = gen_reference.config_rows(_Outer)
    assert rows == [("inner.depth", "int", "`3`", "How deep."),
                    ("inner.names", "list[str]", "`[a, b]`", "Which `names` (see `Thing`)."),
                    ("flag", "bool", "`false`", "A `flag`."),
                    ("extra", "float | None", "`null`", ""),
                    ("rate", "str", '`"x|y"`', "A pipe | in the text.")]
    assert gen_reference._cell("a|b") == "a\\|b"


def test_commands_and_flags_come_from_the_parsers():
    root = argparse.ArgumentParser(prog="tool")
    subs = root.add_subparsers()
    grp = subs.add_parser("grp").add_subparsers()
    leaf = grp.add_parser("leaf", description="does a thing")
    leaf.add_argument("--size", type=int, default=4, metavar="N", help="how big (default %(default)s)")
    leaf.add_argument("--mode", choices=["a", "b"], help="which mode")
    leaf.add_argument("--bare")
    both = subs.add_parser("both")  # runs itself (--run) and has a subcommand
    both.add_argument("--run", help="a run")
    both.add_subparsers().add_parser("render")
    found = gen_reference.commands(root, "tool")
    assert [name for name, _ in found] == ["tool grp leaf", "tool both", "tool both render"]
    actions = {a.dest: a for a in leaf._actions}
    assert gen_reference._flag_name(actions["size"]) == "`--size N`"
    assert gen_reference._flag_default(actions["size"]) == "`4`"
    assert gen_reference._flag_help(leaf, actions["size"]) == "how big (default 4)"
    assert gen_reference._flag_name(actions["mode"]) == "`--mode {a,b}`"


def test_stale_names_a_file_that_differs(tmp_path, monkeypatch):
    monkeypatch.setattr(gen_reference, "OUT_DIR", tmp_path)
    monkeypatch.setattr(gen_reference, "ROOT", tmp_path)
    assert len(gen_reference.stale()) == 2  # nothing written yet
    assert gen_reference.main([]) == 0 and gen_reference.stale() == []
    (tmp_path / "cli.md").write_text((tmp_path / "cli.md").read_text() + "\nedited by hand\n")
    assert gen_reference.stale() == [tmp_path / "cli.md"]
    assert gen_reference.main(["--check"]) == 1
