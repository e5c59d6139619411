"""benchmarks/bench_recipe.py --quick: tokens to each target, the eval stage's probes, alternating step times, the
table; the nanochat variants on top of the speedrun's recipe."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_recipe  # noqa: E402


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_the_nanochat_variants_are_the_speedruns_recipe_with_nanochats_settings(size, tmp_path):
    """``recipe+...`` is the speedrun's own config (nothing pinned) with the variant on top; ``recipe+nanochat`` sets
    each of nanochat's settings, the attention scale 1.44/sqrt(head_dim) of the preset."""
    import torch

    from lmforge.speedrun import PRESETS, RECIPE, _run_config

    assert bench_recipe.settings_of("recipe") == RECIPE and bench_recipe.pinned_of("recipe+nc-wd0", size) == ()
    assert bench_recipe.reference_of("recipe+nc-wd0") == "recipe" and bench_recipe.reference_of("muon") == "baseline"
    names = [n for n in bench_recipe.VARIANTS if n.startswith("nc-")]
    assert len(names) == 7 and bench_recipe.settings_of("nanochat", size) == bench_recipe.settings_of("+".join(names), size)
    preset = PRESETS[size]

    def config(name: str):
        return _run_config(preset, 300, tmp_path, tmp_path / "tok.json", torch.device("cpu"), 400, None,
                           recipe=(*bench_recipe.pinned_of(name, size), *bench_recipe.settings_of(name, size)))

    base, nc = config("recipe"), config("recipe+nanochat")
    assert base == config("recipe+recipe") and base.optimizer.name == "muon"
    o, m = nc.optimizer, nc.model
    assert (o.name, o.embed_lr, o.head_lr, o.weight_decay, tuple(o.betas), o.eps, o.dmodel_lr_scale) == (
        "muon", 0.2, 0.004, 0.0, (0.8, 0.95), 1e-10, True)
    assert (o.muon_momentum_start, o.muon_momentum, o.muon_momentum_warmup_steps) == (0.85, 0.95, 300)
    assert (o.schedule, o.warmup_steps, o.cooldown_frac, o.min_lr) == ("wsd", 0, 0.2, 0.0)
    assert m.embed_norm and m.qk_norm and m.qk_norm_scale == pytest.approx(1.44 / m.head_dim ** 0.5, rel=1e-5)
    old = config("muon")  # a variant without recipe keeps the old recipe pinned
    assert old.optimizer.weight_decay == 0.1 and old.optimizer.embed_lr is None


@pytest.mark.timeout(900)  # ~40 s quiet; minutes on a shared, loaded machine
def test_bench_recipe_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_recipe.py"), "--quick", "--variants",
                          "baseline", "batch-warmup", "recipe+nanochat", "--out", str(tmp_path / "out"), "--cache",
                          str(tmp_path / "cache"), "--json", str(tmp_path / "recipe.json")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    trained = {r["variant"]: r for r in rows if "variant" in r}
    assert list(trained) == ["baseline", "batch-warmup", "recipe+nanochat"]
    assert trained["batch-warmup"]["settings"] == ["training.batch_warmup_steps=50"]
    assert trained["recipe+nanochat"]["settings"] == list(bench_recipe.settings_of("recipe+nanochat", "tiny"))
    assert trained["recipe+nanochat"]["baseline"] == [] and trained["baseline"]["baseline"][:3] == list(bench_recipe.BASELINE)
    for r in trained.values():  # the quick targets (100 and 50 bits/byte) are reached at the first evaluation
        assert r["stopped_at"] == 3 and [s for s, _, _ in r["curve"]] == [3]
        assert r["tokens_to"] == {"100.0": r["curve"][0][2], "50.0": r["curve"][0][2]}
        probes = {k: v for k, v in r.items() if k.startswith(("copy_", "natural_"))}
        assert "copy_first" in probes and 0 < r["final_bpb"] < 20  # every probe field of the eval record is kept
    # the warm-up trains on fewer rows: 2, 3 and 3 of the tiny preset's 8 rows x 64 tokens in the first three steps
    assert trained["batch-warmup"]["tokens_to"]["50.0"] == 8 * 64 and trained["baseline"]["tokens_to"]["50.0"] == 3 * 8 * 64
    assert trained["baseline"]["final_bpb"] != trained["batch-warmup"]["final_bpb"]
    summary = json.loads((tmp_path / "recipe.json").read_text())["variants"]
    for name in (f"{n} @tiny" for n in trained):  # two alternating rounds of unrounded step times, the peak of the same run
        assert len(summary[name]["step_seconds"]) == 2 and all(t > 0 for t in summary[name]["step_seconds"])
        assert all(p > 0 for p in summary[name]["peak_flops"]) and summary[name]["seconds_to"]["50.0"][0] > 0
    assert "fp32 matmul peak" in out.stdout and "| batch-warmup @tiny | 1 | 512 (33%)" in out.stdout.replace(",", "")
    header = next(line for line in out.stdout.splitlines() if line.startswith("| variant | seeds | tokens to"))
    assert all(f"| {k} |" in header for k in probes)  # a column for each probe field
    row = next(line for line in out.stdout.splitlines() if line.startswith("| recipe+nanochat @tiny | 1 | "))
    assert "%" not in row  # no recipe row to compare with in this run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "out", "recipe.json"]
