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


@pytest.mark.timeout(900)
def test_bench_recipe_isoflop_quick(tmp_path):
    """isoflop: each shape trained for the same FLOPs (steps = FLOPs / (FLOPs per token x tokens per step)), its
    tokens per parameter and final bits/byte recorded; isoflop-table fits the best ratio over the shapes."""
    from lmforge.sizing import family, flops_of, params_of

    args = [sys.executable, str(ROOT / "benchmarks/bench_recipe.py")]
    common = ["--quick", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")]
    run = subprocess.run([*args, "isoflop", "--shapes", "d32x1", "d64x1", "d96x1", "--flops", "4e10", "--threads",
                          "1", *common], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "isoflop.jsonl").read_text().splitlines()]
    assert [r["shape"] for r in rows] == ["d32x1", "d64x1", "d96x1"]
    for r in rows:
        preset = family(r["shape"])
        assert r["flops_per_token"] == flops_of(preset, 300) and r["params"] == params_of(preset, 300)
        per_step = preset.batch_size * preset.context_length
        assert r["steps"] == max(10, round(4e10 / (r["flops_per_token"] * per_step)))
        assert r["tokens"] == r["steps"] * per_step and 0 < r["final_bpb"] < 20
    assert rows[0]["steps"] > rows[1]["steps"] > rows[2]["steps"]  # the same FLOPs: smaller shapes train longer
    table = subprocess.run([*args, "isoflop-table", *common, "--json", str(tmp_path / "iso.json")],
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert table.returncode == 0, table.stderr[-2000:]
    fit = json.loads((tmp_path / "iso.json").read_text())["budgets"]["4e+10"]["fit"]
    assert fit["ratio"] > 0 and "fitted best tokens/param:" in table.stdout
