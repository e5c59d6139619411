"""Run reports: the ``report.md`` a run leaves for a person to read, and the markdown it is built from.

:class:`RunReport` is a markdown document built section by section (paragraphs, tables, images, code blocks)
and written atomically. :func:`write_speedrun_report` renders a speedrun's stage records (the contents of
``speedrun.json``) into ``report.md``: results with throughput and MFU against the machine's measured matmul
peak, time per stage, tokenizer, data, samples, the resolved config and the command that reproduces it.
The speedrun computes; this module only presents.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from lmforge.common import atomic_write_text
from lmforge.config import dump_yaml
from lmforge.corpus import EOT
from lmforge.model import flops_per_token, matmul_params_per_token

__all__ = ["REPORT_FILE", "RunReport", "write_speedrun_report", "environment", "fmt_seconds"]

REPORT_FILE = "report.md"


class RunReport:
    """A markdown document: a ``# title``, then sections of paragraphs, tables, images and code blocks."""

    def __init__(self, title: str) -> None:
        self.lines: list[str] = [f"# {title}", ""]

    def section(self, title: str) -> RunReport:
        self.lines += [f"## {title}", ""]
        return self

    def paragraph(self, *lines: str) -> RunReport:
        """Lines of one paragraph, then a blank line."""
        self.lines += [*lines, ""]
        return self

    def table(self, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> RunReport:
        self.lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        self.lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
        self.lines.append("")
        return self

    def image(self, alt: str, path: str) -> RunReport:
        self.lines += [f"![{alt}]({path})", ""]
        return self

    def code(self, text: str, lang: str = "") -> RunReport:
        """A fenced block; a fence inside ``text`` would end it early, so it is written as ``'''``."""
        self.lines += [f"```{lang}", text.replace("```", "'''"), "```", ""]
        return self

    def render(self) -> str:
        return "\n".join(self.lines)

    def write(self, path: str | Path) -> Path:
        atomic_write_text(path, self.render())
        return Path(path)


def fmt_seconds(seconds: float) -> str:
    """``3.25 s``, ``42 s`` or ``2.5 min``: as many digits as a reader needs."""
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def environment(device: Any) -> str:
    """Where a run ran: device, CPU threads, torch version and machine, e.g. ``device `cpu` (2 CPU threads, ...)``."""
    return (f"device `{device}` ({torch.get_num_threads()} CPU threads, torch {torch.__version__}, "
            f"{platform.machine()})")


def _num(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else "n/a"


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _budget_text(budget: Sequence[Any]) -> str:
    kind, amount = budget
    return f"{int(amount)}steps" if kind == "steps" else f"{amount:g}min"


def write_speedrun_report(out: Path, cfg: Any, data: dict[str, Any], ran: list[str], wall: float, device: Any,
                          stages: Sequence[str]) -> Path:
    """Write ``out/report.md`` from a speedrun's records ``data`` (``speedrun.json``), its stages in order.

    ``ran``: the stages this invocation ran (the others were reused); ``wall``: its seconds; ``cfg``: the
    resolved run config of ``out/run``.
    """
    st, settings = data["stages"], data["settings"]
    tok, splits, plan, tr, ev, smp = (st["tokenizer"], st["data"]["splits"], st["plan"], st["train"], st["eval"],
                                      st["samples"])
    tps_logged = sorted(r["tokens_per_s"] for r in _read_metrics(out / "run" / "metrics.jsonl")
                        if r.get("tokens_per_s"))
    tps = tps_logged[len(tps_logged) // 2] if tps_logged else float("nan")
    peak = plan.get("peak_flops") or cfg.training.peak_flops  # the matmul peak measured by the plan stage
    mfu = tps * flops_per_token(cfg.model, cfg.context_length) / peak if peak else None
    report = RunReport("lmforge speedrun report").paragraph(
        f"Corpus `{settings['corpus']}`, model size `{settings['model_size']}`, training budget "
        f"{settings['budget'][1]:g} {settings['budget'][0]}, {environment(device)}.",
        f"This invocation ran: {', '.join(ran) if ran else 'nothing (every stage was reused)'}; wall time "
        f"{fmt_seconds(wall)}.")
    report.section("Results").table(("metric", "value"), [
        ("final validation loss", f"{ev['val_loss']:.4f} nats/token (perplexity {ev['val_ppl']:.1f})"),
        ("bits per byte (validation)", f"{ev['val_bpb']:.4f}"),
        ("last training loss", _num(tr.get("loss"))),
        ("steps / tokens seen", f"{tr['step']:,} / {tr['tokens']:,}"),
        ("training throughput", f"{tps:,.0f} tokens/s (median of logged intervals)"),
        ("MFU", f"{100 * mfu:.1f}% of {peak / 1e9:,.0f} GFLOP/s" if mfu else "n/a"),
        ("parameters (matmul weights)", f"{matmul_params_per_token(cfg.model):,}"),
        ("generation", f"{smp['generation_tokens_per_s']:,.0f} tokens/s (batch {smp['generation_batch']}, KV cache)"),
    ])
    report.paragraph("Validation loss is measured on the final checkpoint over "
                     f"{ev['val_tokens']:,} validation tokens; bits per byte = loss / ln 2 / (UTF-8 bytes per token).")
    report.image("loss curves", "run/loss.png")
    report.section("Time per stage").table(
        ("stage", "time", "this run"),
        [(name, fmt_seconds(st[name]["seconds"]), "ran" if name in ran else "reused") for name in stages])
    how = f"from a measured {plan['step_seconds']:.3f} s/step" if plan["step_seconds"] else "as asked"
    report.paragraph(f"Planned {plan['max_steps']} training steps {how}.")
    report.section("Tokenizer").paragraph(
        f"Byte-level BPE (GPT-2 pre-tokenizer) with {tok['vocab_size']:,} tokens including `{EOT}`, "
        f"trained on the corpus: `tokenizer.json` (fingerprint `{tok['fingerprint'][:16]}`).")
    report.section("Data").table(
        ("split", "documents", "tokens", "text bytes", "bytes/token"),
        [(name, f"{s['documents']:,}", f"{s['tokens']:,}", f"{s['text_bytes']:,}", f"{s['bytes_per_token']:.3f}")
         for name, s in splits.items()])
    report.section("Samples").paragraph(
        "Temperature 0.8, top-k 50, seed 0; the prompt is in **bold** on the first line of each block.")
    for s in smp["samples"]:
        report.paragraph(f"**{s['prompt'].strip()}**").code(s["prompt"] + s["text"], "text")
    report.section("Configuration").paragraph("Resolved run config (`run/config.yaml`):")
    report.code(dump_yaml(cfg).rstrip(), "yaml")
    report.paragraph(
        f"Reproduce: `lmforge speedrun --out {out} --corpus {settings['corpus']} --model-size "
        f"{settings['model_size']} --budget {_budget_text(settings['budget'])} --vocab-size "
        f"{settings['vocab_size']}`; generate more: "
        f"`lmforge generate --run {out / 'run'} --prompt 'ROMEO:'`.")
    return report.write(out / REPORT_FILE)
