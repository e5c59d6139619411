"""The GPU check's report: the targets of issue 24 read from the figures, and the summary tables (markdown).

Both read only the check's JSON document (``gpu_check.json``), so a report can be redrawn from a saved run:
``python tools/gpu_report.py OUT/gpu_check.json``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# (name, what, wanted value): a measured figure against each target of the issue (reported; not the exit code)
TARGETS = (("mfu_gpt2", "bf16 MFU against the measured peak, GPT-2 small shape (lmforge, best mode)", 0.45),
           ("mfu_d20", "bf16 MFU against the measured peak, d20 shape (lmforge, best mode)", 0.50),
           ("train_vs_hf", "training tokens/s vs HF, GPT-2 small shape (best of each; HF: whole-model "
                           "torch.compile, fused AdamW, bf16 autocast)", 1.2),
           ("generate_b1_vs_hf", "generation batch 1 vs HF's fastest (static cache + its compile)", 2.0),
           ("serve_vs_hf", "serving 64 streaming clients vs sequential HF generate (a weaker peer: HF one "
                           "request at a time, no batching)", 10.0))


def _records(doc: dict[str, Any], stage: str, kind: str) -> list[dict[str, Any]]:
    return [r for r in doc.get("stages", {}).get(stage, {}).get("records", []) if r.get("kind") == kind]


def _best(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return max(vals) if vals else None


def targets(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{name: {"what", "want", "got", "met"}}``; ``got`` None where the figure was not measured."""
    got: dict[str, float | None] = {}
    for name, stage in (("mfu_gpt2", "train-gpt2"), ("mfu_d20", "train-d20")):
        got[name] = _best([r for r in _records(doc, stage, "train") if r["impl"] == "lmforge"], "mfu")
    rows = _records(doc, "train-gpt2", "train")
    ours, hf = (_best([r for r in rows if r["impl"] == i], "tokens_per_s") for i in ("lmforge", "hf"))
    got["train_vs_hf"] = ours / hf if ours and hf else None
    gen = [r for r in _records(doc, "generate", "generate") if r["batch"] == 1]
    ours, hf = (_best([r for r in gen if r["impl"] in mine], "tokens_per_s")  # lmforge's two fast modes, HF's two
                for mine in (("lmforge", "lmforge_compiled"), ("hf_dynamic", "hf_static_compiled")))
    got["generate_b1_vs_hf"] = ours / hf if ours and hf else None
    got["serve_vs_hf"] = _best(_records(doc, "serve", "serve"), "ratio")
    return {n: {"what": what, "want": want, "got": got[n], "met": None if got[n] is None else got[n] >= want}
            for n, what, want in TARGETS}


def _f(x: Any, fmt: str = ".1f", scale: float = 1.0, suffix: str = "") -> str:
    return "-" if x is None else f"{x * scale:{fmt}}{suffix}"


def _stage_result(name: str, st: dict[str, Any]) -> str:
    recs = st.get("records", [])
    failed = [r["test"].split(" ", 1)[0] for r in recs if r.get("kind") == "pytest_failure"]
    if failed:  # named as they failed, so a run cut at its cap names them too
        return f"failed: {', '.join(failed)}"[:400].replace("|", "/")
    if st["status"] != "ok" and st.get("note"):
        return st["note"].strip().splitlines()[-1][:120].replace("|", "/")
    for r in recs:
        if r.get("kind") == "pytest":
            return r.get("summary", "")
        if r.get("kind") == "probe":
            return f"{r['name']}: peak {_f(r['peak_flops'], '.0f', 1e-12)} TFLOP/s at {r['peak_n']}^3"
        if r.get("kind") == "resume":
            return f"bitwise {r['bitwise']}, max rel diff {r['max_rel_diff']:.2e}, killed after step {r['killed_after_step']}"
        if r.get("kind") in ("loop", "speedrun"):
            return (f"{_f(r.get('tokens_per_s'), ',.0f')} tokens/s, MFU {_f(r.get('mfu'), '.1f', 100, '%')} of the "
                    f"measured peak, {_f(r.get('mfu_datasheet'), '.1f', 100, '%')} of the datasheet")
        if r.get("kind") == "serve":
            return f"{r['clients']} clients: {r['ratio']:.1f}x sequential HF (one request at a time)"
        if r.get("kind") == "profile":
            parts = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["shares"].items(), key=lambda kv: -kv[1]))
            return f"{r['ms_per_step']:.1f} ms/step ({r['time']}): {parts}"
    gen = {(r["batch"], r["impl"]): r["tokens_per_s"] for r in recs if r.get("kind") == "generate"}
    if gen:
        batches = sorted({b for b, _ in gen})
        hf = {b: max(v for (bb, i), v in gen.items() if bb == b and i.startswith("hf")) for b in batches}
        return ", ".join(f"batch {b}: {gen[b, 'lmforge'] / hf[b]:.2f}x" for b in batches) + " HF's fastest"
    mfus = {r["impl"] + "/" + r["compile"]: r.get("mfu") for r in recs if r.get("kind") == "train"}
    if mfus:
        return "MFU of the measured peak: " + ", ".join(f"{k} {_f(v, '.1f', 100, '%')}" for k, v in mfus.items())
    return ""


def summary(doc: dict[str, Any]) -> str:
    """The markdown report: stages, training, generation, serving, resume, targets."""
    dev = doc.get("device", {})
    probe = next(iter(_records(doc, "probe", "probe")), {})
    lines = [f"## lmforge GPU check: {dev.get('name') or 'CPU'}, torch {dev.get('torch')}, {doc.get('started')}"
             + (" (dry run: CPU, tiny shapes; the figures mean nothing)" if doc.get("dry_run") else ""), "",
             f"{doc.get('elapsed_s', 0):.0f} s of a {doc.get('budget_s', 0):.0f} s budget; measured peak "
             f"{_f(probe.get('peak_flops'), '.1f', 1e-12)} TFLOP/s ({probe.get('peak_n', '-')}^3 products), datasheet "
             f"{_f(probe.get('datasheet_bf16_flops'), '.0f', 1e-12)} TFLOP/s", "",
             "| stage | status | seconds (cap) | result |", "|---|---|---:|---|"]
    for name, st in doc.get("stages", {}).items():
        lines.append(f"| {name} | {st['status']} | {st['seconds']:.0f} ({st['cap_s']:.0f}) | {_stage_result(name, st)} |")
    train = [r for s in ("train-gpt2", "train-d20") for r in _records(doc, s, "train")]
    if train:
        lines += ["", "### bf16 training: MFU against the measured peak and against the datasheet peak", "",
                  f"Denominators: measured {_f(probe.get('peak_flops'), '.1f', 1e-12)} TFLOP/s, datasheet "
                  f"{_f(probe.get('datasheet_bf16_flops'), '.0f', 1e-12)} TFLOP/s. Each row's configuration is named; "
                  "a weaker variant says so.", "",
                  "| shape | impl | compile | configuration | batch x ctx | tokens/s | step ms | MFU (measured peak) | "
                  "MFU (datasheet) | peak GiB | warm-up s | first loss |",
                  "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in train:
            lines.append(f"| {r['shape']} | {r['impl']} | {r['compile']} | {r.get('config', '-')} | "
                         f"{r['batch']} x {r['context']} | "
                         f"{r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {_f(r['mfu'], '.1f', 100, '%')} | "
                         f"{_f(r['mfu_datasheet'], '.1f', 100, '%')} | {_f(r['peak_mem_gib'])} | {r['warmup_s']:.1f} | "
                         f"{r['first_step_loss']:.4f} |")
    gen = _records(doc, "generate", "generate")
    if gen:
        lines += ["", "### greedy generation, bf16: tokens/s", "", "| batch | impl | tokens/s | warm-up s | "
                  "bf16 tokens equal to HF's |", "|---:|---|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {r['impl']} | {r['tokens_per_s']:,.0f} | {r['warmup_s']:.1f} | "
                  f"{r['bf16_tokens_equal_hf']:.0%} |" for r in gen]
    for r in _records(doc, "profile", "profile"):
        lines += ["", f"### one compiled training step ({r['shape']}, batch {r['batch']}): the top kernels", "",
                  "| kernel | kind | ms per step | calls |", "|---|---|---:|---:|"]
        lines += [f"| `{t['name'][:80].replace('|', '/')}` | {t['kind']} | {t['ms']:.2f} | {t['calls']} |"
                  for t in r["top"]]
    for r in _records(doc, "serve", "serve"):
        lines += ["", "### serving (float32, streaming clients) against HF generate one request at a time (HF ships no "
                  "server: a weaker peer)", "", "| clients | lmforge serve tokens/s | "
                  "HF sequential tokens/s | ratio | TTFT p50 ms | texts equal to HF |", "|---:|---:|---:|---:|---:|---:|",
                  f"| {r['clients']} | {r['tokens_per_s']:,.0f} | {r['hf_sequential_tokens_per_s']:,.0f} | "
                  f"{r['ratio']:.1f}x | {r['ttft_p50_ms']:.0f} | {r['texts_equal_hf']} |"]
    lines += ["", "### targets (issue 24; reported, not part of the exit code)", "", "| target | want | got | met |",
              "|---|---:|---:|---|"]
    for t in targets(doc).values():
        pct = t["want"] < 1
        lines.append(f"| {t['what']} | {_f(t['want'], '.0f' if pct else '.1f', 100 if pct else 1, '%' if pct else 'x')} "
                     f"| {_f(t['got'], '.1f', 100 if pct else 1, '%' if pct else 'x')} | "
                     f"{'-' if t['met'] is None else 'yes' if t['met'] else 'no'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(json.loads(open(sys.argv[1]).read())))
