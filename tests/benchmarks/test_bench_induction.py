"""benchmarks/bench_induction.py: the copy rows repeat a span as documented, and on them the key offset learns to
copy where the plain model has not started."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_induction  # noqa: E402


def test_copy_rows_mask_exactly_the_repeated_ids():
    gen = torch.Generator().manual_seed(3)
    ids, mask = bench_induction.copy_batch(gen, 64, 80, 50)
    lo, hi = bench_induction.SPAN
    for row, m in zip(ids, mask):
        js = m.nonzero().flatten().tolist()
        assert lo - 1 <= len(js) <= hi - 1 and js == list(range(js[0], js[0] + len(js)))  # one run of targets
        n = len(js) + 1
        second = js[0]  # the repeat starts at ids[second]; its first id is not a target
        gaps = [second - n - g for g in range(n + 1) if second - n - g >= 0
                and torch.equal(row[second - n - g:second - g], row[second:second + n])]
        assert gaps, "the masked span repeats no earlier span within its gap range"


def test_the_key_offset_copies_sooner_than_the_plain_model(tmp_path):
    rows = bench_induction.main(["--quick", "--threads", "1", "--json", str(tmp_path / "i.json")])
    last = {r["variant"]: r["curve"][-1][1] for r in rows}
    assert last["key-offset"] < 0.6 * last["plain"], last
    assert (tmp_path / "i.json").exists()
