"""Config machinery: YAML -> dataclasses, --set overrides, typo hints, type checks, diffs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from lmforge.config import apply_overrides, diff_dicts, dump_yaml, from_dict, load_yaml, nearest_key, to_dict


@dataclass
class Inner:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    schedule: Literal["cosine", "constant"] = "cosine"

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"inner.lr must be > 0 (got {self.lr}); try 3e-4")


@dataclass
class Outer:
    name: str
    steps: int = 10
    compile: bool = False
    device: str | None = None
    inner: Inner = field(default_factory=Inner)


def test_from_dict_fills_nested_and_defaults() -> None:
    cfg = from_dict(Outer, {"name": "x", "inner": {"lr": 0.5, "betas": [0.8, 0.9]}})
    assert cfg == Outer(name="x", inner=Inner(lr=0.5, betas=(0.8, 0.9)))
    assert isinstance(cfg.inner.betas, tuple)


def test_yaml_11_exponent_strings_become_floats() -> None:
    assert from_dict(Inner, {"lr": "3e-4"}).lr == 3e-4


def test_unknown_key_names_nearest_valid_key() -> None:
    with pytest.raises(ValueError, match=r"unknown config key 'inner\.lrr'.*did you mean 'inner\.lr'"):
        from_dict(Outer, {"name": "x", "inner": {"lrr": 1.0}})
    with pytest.raises(ValueError, match=r"'stesp'.*did you mean 'steps'"):
        from_dict(Outer, {"name": "x", "stesp": 1})
    assert nearest_key("zzzz", ["steps", "name"]) is None
    with pytest.raises(ValueError, match=r"unknown config key 'inner\.lrr' \(did you mean 'inner\.lr'"):
        from_dict(Inner, {"lrr": 1.0}, path="inner")  # a section prefix with or without the dot


@pytest.mark.parametrize("d, msg", [
    ({"name": "x", "steps": "ten"}, r"'steps' must be an integer"),
    ({"name": "x", "steps": 1.5}, r"'steps' must be an integer"),
    ({"name": "x", "compile": "yes"}, r"'compile' must be true or false"),
    ({"name": 3}, r"'name' must be a string"),
    ({"name": "x", "inner": {"schedule": "linear"}}, r"'inner\.schedule' must be one of 'cosine', 'constant'"),
    ({"name": "x", "inner": {"lr": True}}, r"'inner\.lr' must be a number"),
    ({"name": "x", "inner": 5}, r"'inner' must be a mapping"),
    ({}, r"missing required key\(s\): name"),
])
def test_type_errors_name_the_field(d: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        from_dict(Outer, d)


def test_post_init_validation_runs() -> None:
    with pytest.raises(ValueError, match=r"inner\.lr must be > 0"):
        from_dict(Outer, {"name": "x", "inner": {"lr": -1}})


def test_overrides_parse_yaml_scalars_and_create_sections() -> None:
    d = {"name": "x", "inner": {"lr": 0.1}}
    out = apply_overrides(d, ["steps=20", "inner.lr=1e-2", "compile=true", "device=null", "inner.betas=[0.5, 0.6]"])
    assert d == {"name": "x", "inner": {"lr": 0.1}}  # input untouched
    cfg = from_dict(Outer, out)
    assert (cfg.steps, cfg.inner.lr, cfg.compile, cfg.device, cfg.inner.betas) == (20, 0.01, True, None, (0.5, 0.6))
    assert from_dict(Outer, apply_overrides({}, ["name=abc", "inner.schedule=constant"])).inner.schedule == "constant"


@pytest.mark.parametrize("bad, msg", [
    ("steps", r"must look like section\.key=value"),
    ("inner..lr=1", r"empty key"),
    ("name.sub=1", r"'name' is a value, not a section"),
])
def test_override_errors(bad: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        apply_overrides({"name": "x"}, [bad])


def test_override_typo_is_caught_with_hint() -> None:
    with pytest.raises(ValueError, match=r"did you mean 'inner\.lr'"):
        from_dict(Outer, apply_overrides({"name": "x"}, ["inner.lf=0.1"]))
    with pytest.raises(ValueError, match=r"'steps' must be an integer"):
        from_dict(Outer, apply_overrides({"name": "x"}, ["steps=abc"]))


def test_yaml_round_trip(tmp_path) -> None:
    cfg = Outer(name="run", steps=7, inner=Inner(lr=2e-4))
    path = tmp_path / "c.yaml"
    dump_yaml(cfg, path)
    assert from_dict(Outer, load_yaml(path)) == cfg
    assert to_dict(cfg)["inner"]["betas"] == [0.9, 0.95]


def test_load_yaml_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_yaml(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_yaml(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert load_yaml(tmp_path / "empty.yaml") == {}


def test_diff_dicts() -> None:
    a = {"model": {"d": 1, "h": 2}, "training": {"steps": 5}}
    b = {"model": {"d": 1, "h": 4}, "training": {"steps": 9}, "new": 1}
    assert diff_dicts(a, b) == [("model.h", 2, 4), ("training.steps", 5, 9), ("new", None, 1)]
