"""Run reports: the ``report.md`` a run leaves for a person to read, and the markdown it is built from.

Every run gets a card (:func:`write_run_card`): ``report.md`` + ``report.json`` in the run directory, rewritten
by the CLI after ``train``, ``eval`` and ``speedrun``; :func:`compare_runs` puts several runs side by side.

:class:`RunReport` is a markdown document built section by section (paragraphs, tables, images, code blocks)
and written atomically. :func:`write_speedrun_report` renders a speedrun's stage records (the contents of
``speedrun.json``) into ``report.md``: results with throughput and MFU against the machine's measured matmul
peak, time per stage, tokenizer, data, samples, the resolved config and the command that reproduces it.
The speedrun computes; this module only presents.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from lmforge.common import atomic_write_text
from lmforge.config import dump_yaml
from lmforge.corpus import EOT
from lmforge.model import flops_per_token, matmul_params_per_token
from lmforge.run import read_base

__all__ = ["REPORT_FILE", "CARD_JSON", "RunReport", "write_speedrun_report", "environment", "fmt_seconds",
           "collect_run_card", "render_run_card", "write_run_card", "compare_runs", "lmforge_commit"]

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


def _num(x: Any, spec: str = ".4f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "n/a"


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _budget_text(budget: Sequence[Any]) -> str:
    kind, amount = budget
    return f"{int(amount)}steps" if kind == "steps" else f"{amount:g}min"


def _pair_text(first: float | None, second: float | None) -> str:
    """A probe's pair as "second as a share of first (first -> second nats)"; n/a where the probe did not run."""
    if first is None or second is None:
        return "n/a"
    return f"{second / first:.0%} ({first:.2f} -> {second:.2f} nats)"


def _probe_rows(ev: dict[str, Any]) -> list[tuple[str, str]]:
    """The eval stage's context probes (``lmforge.evals.probes``) as table rows: each second occurrence's loss as a
    share of the first's."""
    shuffled = ev.get("copy_shuffled")
    order = (f"{ev['copy_second'] / ev['copy_first']:.0%} of the first occurrence's {ev['copy_first']:.2f} nats in "
             f"order, {'n/a' if shuffled is None else format(shuffled / ev['copy_first'], '.0%')} shuffled "
             "(a copier: ~0% in order, 100% or more shuffled; a bag of recent tokens: the same share both ways)")
    return [("in-context copying: random ids given twice", order),
            ("in-context copying: validation text given twice",
             _pair_text(ev.get("natural_first"), ev.get("natural_second"))),
            ("in-context copying: a made-up name mentioned twice",
             _pair_text(ev.get("name_first"), ev.get("name_second")))]


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
    from lmforge.hardware import resolve_train_dtype

    # the precision the plan measured in (a plan recorded before it named one: the run's, ``auto`` resolved)
    peak_dtype = plan.get("peak_dtype") or resolve_train_dtype(cfg.training.dtype, device)
    report = RunReport("lmforge speedrun report").paragraph(
        f"Corpus `{settings['corpus']}`, model size `{settings['model_size']}`, training budget "
        f"{settings['budget'][1]:g} {settings['budget'][0]}, {environment(device)}.",
        f"This invocation ran: {', '.join(ran) if ran else 'nothing (every stage was reused)'}; wall time "
        f"{fmt_seconds(wall)}.")
    report.section("Results").table(("metric", "value"), [
        ("final validation loss", f"{ev['val_loss']:.4f} nats/token (perplexity {ev['val_ppl']:.1f})"),
        ("bits per byte (validation)", f"{ev['val_bpb']:.4f}"),
        *_probe_rows(ev),
        ("last training loss", _num(tr.get("loss"))),
        ("steps / tokens seen", f"{tr['step']:,} / {tr['tokens']:,}"),
        ("training throughput", f"{tps:,.0f} tokens/s (median of logged intervals)"),
        ("MFU", f"{100 * mfu:.1f}% vs the measured {peak_dtype} matmul peak ({peak / 1e9:,.0f} GFLOP/s, measured "
                "before training)" if mfu else "n/a"),
        ("parameters (matmul weights)", f"{matmul_params_per_token(cfg.model):,}"),
        ("generation", f"{smp['generation_tokens_per_s']:,.0f} tokens/s (batch {smp['generation_batch']}, KV cache)"),
    ])
    if "target" in st:
        report.paragraph(f"Pretraining {st['target']['text']}. The target is judged on the validation batches of "
                         "the final figure below, scored whenever the periodic estimate (every "
                         f"{cfg.training.eval_every} steps on {cfg.training.eval_batches} batches) reached it.")
    report.paragraph("Validation loss is measured on the final checkpoint over "
                     f"{ev['val_tokens']:,} validation tokens; bits per byte = loss / ln 2 / (UTF-8 bytes per token).")
    report.image("loss curves", "run/loss.png")
    report.section("Time per stage").table(
        ("stage", "time", "this run"),
        [(name, fmt_seconds(st[name]["seconds"]), "ran" if name in ran else "reused") for name in stages])
    how = f"from a measured {plan['step_seconds']:.3f} s/step" if plan["step_seconds"] else "as asked"
    report.paragraph(f"Planned {plan['max_steps']} training steps {how}.")
    if plan.get("sizing"):
        size = plan["sizing"]
        report.section("Model size").paragraph(f"`--model-size auto` chose {size['text']}. Rule: {size['rule']}.")
        report.table(("candidate", "parameters", "s/step", "GFLOP/s", "steps", "tokens", "tokens/param", "FLOPs"), [
            (f"**{r['name']}**" if r["name"] == size["chosen"] else r["name"], f"{r['params']:,}",
             _num(r["step_seconds"], ".3f"), _num(r["flops_per_s"] / 1e9 if r["flops_per_s"] else None, ".0f"),
             f"{r['steps']:,}", f"{r['tokens']:,}", f"{r['tokens_per_param']:.3g}", f"{r['compute']:.3g}")
            for r in size["candidates"]])
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
    if "chat-sft" in st:
        _chat_section(report, st, out)
    if "rl" in st:
        _rl_speedrun_section(report, st)
    report.section("Configuration").paragraph("Resolved run config (`run/config.yaml`):")
    report.code(dump_yaml(cfg).rstrip(), "yaml")
    report.paragraph(
        f"Reproduce: `lmforge speedrun --out {out} --corpus {settings['corpus']} --model-size "
        f"{settings['model_size']} --budget {_budget_text(settings['budget'])} --vocab-size "
        f"{settings['vocab_size']}`; generate more: "
        f"`lmforge generate --run {out / 'run'} --prompt 'ROMEO:'`.")
    return report.write(out / REPORT_FILE)


def _chat_section(report: RunReport, st: dict[str, Any], out: Path) -> None:
    """The speedrun's chat stages: task accuracy after each stage (base, midtrained, SFT, RL), ended replies, a
    conversation."""
    base, after, ft = st["chat-base"], st["chat-sft"], st["sft"]
    report.section("Chat: fine-tuned on the built-in tasks")
    if "chat-mid" in st:
        mt, mid = st["midtrain"], st["chat-mid"]
        report.paragraph(
            f"`lmforge midtrain` first continued the pretrained model for {mt['step']} steps "
            f"({fmt_seconds(mt['seconds'])}) into `midtrain/` on its corpus mixed with the chat tasks' training "
            "conversations (half of each batch's rows; every token trained, as nanochat's midtraining), then "
            f"fine-tuning started from it. Validation bits per byte after midtraining: {mid['val_bpb']:.4f} "
            f"(after pretraining: {st['eval']['val_bpb']:.4f}, the same {mid['val_tokens']:,} tokens).")
    report.paragraph(
        f"`lmforge sft` on the built-in chat tasks (`lmforge data get chat-tasks`) for {ft['step']} steps "
        f"({fmt_seconds(ft['seconds'])}, the same training loop with the loss on assistant tokens only) into `sft/`. "
        "Exact match of greedy replies (calculator calls run) on validation items never seen in training, after "
        "each stage (base: the pretrained model with the chat tokens added):")
    stages = [("base", base)] + ([("midtrained", st["chat-mid"])] if "chat-mid" in st else []) + [("SFT", after)] + \
        ([("RL", st["chat-rl"])] if "chat-rl" in st else [])
    rows = []
    for tag in base["tasks"]:
        a = after["tasks"][tag]
        rows.append((tag, f"{a['n']}", *(f"{100 * r['tasks'][tag]['correct'] / r['tasks'][tag]['n']:.0f}%"
                                          for _, r in stages), f"{100 * a['ended'] / a['n']:.0f}%"))
    rows.append(("all", f"{sum(a['n'] for a in after['tasks'].values())}",
                 *(f"{100 * r['accuracy']:.1f}%" for _, r in stages), f"{100 * after['ended']:.0f}%"))
    report.table(("task", "items", *(name for name, _ in stages), "replies ending with `<|assistant_end|>` (SFT)"),
                 rows)
    report.paragraph(f"Before fine-tuning, {100 * base['ended']:.0f}% of replies ended with the end token.",
                     f"A conversation with the fine-tuned model (greedy; `lmforge chat --run {out / 'sft'}` to talk "
                     "to it):")
    lines = []
    for m in after["conversation"]:
        text = m["content"] if "tool_call" not in m else f"{m['content']}[calculator: {m['tool_call']}]"
        lines.append(f"{m['role']:>9}: {text}")
    report.code("\n".join(lines), "text")


def _rl_speedrun_section(report: RunReport, st: dict[str, Any]) -> None:
    """The speedrun's RL stage: which tasks it trained on, its reward, and every task's exact match after SFT and
    after RL with 95% Wilson intervals."""
    from lmforge.evals.stats import wilson_interval

    rl, sft = st["rl"], st["chat-sft"]
    report.section("Reinforcement learning on the tasks SFT half solves")
    if not rl["tasks"]:
        report.paragraph("No chat task had an exact match between 5% and 80% after fine-tuning (too rare a right "
                         "answer to learn from, or little left to gain), so RL did not run.")
        return
    report.paragraph(
        f"`lmforge rl` from `sft/` on the training items of {', '.join(f'`{t}`' for t in rl['tasks'])} (the tasks "
        f"the fine-tuned model solves 5-80% of the time) for {rl['step']} steps ({fmt_seconds(rl['seconds'])}; "
        f"64 replies per step, exact-match reward, group-mean advantages, the same training loop). Mean reward "
        f"{rl['reward_first']:.2f} at the first step, {rl['reward_last10']:.2f} over the last 10. Exact match of "
        "greedy replies on the same held-out items as above, after SFT and after RL (95% Wilson intervals):")
    if "chat-rl" not in st:
        return
    rows = []
    for tag, a in sft["tasks"].items():
        b = st["chat-rl"]["tasks"][tag]
        (al, ah), (bl, bh) = wilson_interval(a["correct"], a["n"]), wilson_interval(b["correct"], b["n"])
        rows.append((tag + (" (trained)" if tag in rl["tasks"] else ""), a["n"],
                     f"{100 * a['correct'] / a['n']:.0f}% [{100 * al:.0f}, {100 * ah:.0f}]",
                     f"{100 * b['correct'] / b['n']:.0f}% [{100 * bl:.0f}, {100 * bh:.0f}]",
                     f"{100 * (b['correct'] / b['n'] - a['correct'] / a['n']):+.0f}"))
    report.table(("task", "items", "after SFT", "after RL", "change (points)"), rows)


# ==================================================================================================
# Run cards: report.md + report.json in every run directory
# ==================================================================================================
CARD_JSON = "report.json"
CARD_SAMPLE_PROMPTS = ("ROMEO:", "The ")


def lmforge_commit() -> str | None:
    """The git commit of the lmforge source in use (``None`` when it is not a git checkout)."""
    import subprocess

    try:
        res = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    dirty = ""
    if res.returncode == 0:
        st = subprocess.run(["git", "-C", str(Path(__file__).parent), "status", "--porcelain", "--", "."],
                            capture_output=True, text=True, timeout=10)
        dirty = "+dirty" if st.returncode == 0 and st.stdout.strip() else ""
    return res.stdout.strip() + dirty if res.returncode == 0 else None


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _base_run(run: Path) -> Any:
    """What a fine-tuning run records as its base (:data:`lmforge.run.BASE_FILE`), or None."""
    return read_base(run)


def _peak(previous: dict[str, Any], config: dict[str, Any]) -> tuple[float, str, str]:
    """The peak FLOP/s for MFU, where it comes from, and its precision: the run's configured
    ``training.peak_flops`` (the speedrun measures it in the run's precision before training), else the
    machine's matmul peak measured now in the precision the run trained in (reused from the previous card on
    this host when that measured the same precision)."""
    from lmforge.hardware import train_peak_flops

    training = config.get("training") or {}
    dtype = str(training.get("dtype") or "fp32")  # the loop saves the resolved precision
    configured = training.get("peak_flops")
    if configured:
        return float(configured), f"the run's training.peak_flops, for {dtype} training", dtype
    old = previous.get("hardware") or {}
    if (old.get("host") == platform.node() and old.get("matmul_peak_flops")
            and old.get("matmul_peak_dtype") == dtype):
        return float(old["matmul_peak_flops"]), old.get("matmul_peak_source", "measured"), dtype
    peak, dtype = train_peak_flops(dtype, "cpu", repeats=5, max_seconds=0.5)
    return peak, f"{dtype} matmul peak measured on {time.strftime('%Y-%m-%d')}", dtype


def _samples(run: Path, n: int) -> list[dict[str, str]]:
    from lmforge.generate import Generator

    gen = Generator.from_run(run, device="cpu")
    return [{"prompt": p, "text": gen.generate(p, max_new_tokens=48, temperature=0.8, top_k=50, seed=0)}
            for p in CARD_SAMPLE_PROMPTS[:n]]


def collect_run_card(run_dir: str | Path, samples: int = 2) -> dict[str, Any]:
    """Every fact of a run's card as a dict (what ``report.json`` holds); see :func:`write_run_card`."""
    from lmforge import __version__
    from lmforge.data.shards import load_manifest
    from lmforge.evals import read_results
    from lmforge.model import ModelConfig, matmul_params_per_token, flops_per_token
    from lmforge.config import from_dict, load_yaml
    from lmforge.run import MARKER, require_run
    from lmforge.checkpoint import CheckpointManager
    from lmforge.tokenizer import Tokenizer

    run = require_run(run_dir, needs=("config.yaml",))
    config = load_yaml(run / "config.yaml")
    marker = json.loads((run / MARKER).read_text(encoding="utf-8")) if (run / MARKER).is_file() else {}
    previous = json.loads((run / CARD_JSON).read_text(encoding="utf-8")) if (run / CARD_JSON).is_file() else {}
    mcfg = from_dict(ModelConfig, config.get("model"), path="model")
    metrics = _read_metrics(run / "metrics.jsonl")
    train = [r for r in metrics if "loss" in r]
    val = [r for r in metrics if "val_loss" in r]
    steps = CheckpointManager(run).steps()
    tps = _median([r["tokens_per_s"] for r in train if r.get("tokens_per_s")])
    mfu_logged = _median([r["mfu"] for r in train if r.get("mfu")])
    peak, source, peak_dtype = _peak(previous, config)
    ctx = int(config.get("model", {}).get("context_length") or mcfg.context_length)
    card: dict[str, Any] = {
        "run": str(run.resolve()), "name": run.name, "created": marker.get("created"),
        "lmforge": {"version": __version__, "commit": lmforge_commit(), "created_by": marker.get("created_by")},
        "model": {"matmul_params": matmul_params_per_token(mcfg), "context_length": mcfg.context_length,
                  "d_model": mcfg.d_model, "n_layers": mcfg.n_layers, "vocab_size": mcfg.vocab_size},
        "checkpoint": {"step": steps[-1][0] if steps else None, "file": str(steps[-1][1]) if steps else None},
        "training": {"steps": train[-1]["step"] if train else None, "tokens": train[-1].get("tokens") if train else None,
                     "last_loss": train[-1]["loss"] if train else None, "tokens_per_s": tps},
        "validation": {k: val[-1].get(k) for k in ("step", "val_loss", "val_ppl", "val_bpb")} if val else None,
        "hardware": {"host": platform.node(), "machine": platform.machine(), "cpu_threads": torch.get_num_threads(),
                     "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                     "matmul_peak_flops": peak, "matmul_peak_source": source,
                     "matmul_peak_dtype": peak_dtype},
        "base_run": _base_run(run),
        "evals": read_results(run),
        "config": config,
    }
    card["training"]["mfu"] = mfu_logged if mfu_logged is not None else (
        tps * flops_per_token(mcfg, ctx) / peak if tps and peak else None)
    card["training"]["mfu_basis"] = ((f"as logged in training, vs the run's training.peak_flops ({peak_dtype} "
                                      "training; a speedrun sets it to the matmul peak it measured in that precision)"
                                      if (config.get("training") or {}).get("peak_flops") else
                                      "as logged in training, vs the GPU's datasheet bf16 peak")
                                     if mfu_logged is not None else
                                     f"median logged tokens/s vs the measured {peak_dtype} matmul peak below")
    if (run / "tokenizer.json").is_file():
        tok = Tokenizer.load(run / "tokenizer.json")
        card["tokenizer"] = {"fingerprint": tok.fingerprint(), "vocab_size": tok.vocab_size}
    data_dir = (config.get("data") or {}).get("dir")
    kind = (config.get("data") or {}).get("kind")
    if data_dir and kind in ("conversations", "prompts"):
        from lmforge.data.conversations import read_manifest

        m = read_manifest(data_dir)  # rendered conversations (or RL prompts): counts and the source files' sha256
        card["data"] = {"dir": str(data_dir), "kind": kind,
                        "tokenizer_fingerprint": m["tokenizer"]["fingerprint"], "splits": m["splits"]}
    elif data_dir and (Path(data_dir) / "manifest.json").is_file():
        m = load_manifest(Path(data_dir))
        card["data"] = {"dir": str(data_dir), "tokenizer_fingerprint": m["tokenizer"]["fingerprint"],
                        "splits": {k: {x: v.get(x) for x in ("tokens", "documents", "text_bytes")}
                                   for k, v in m["splits"].items()},
                        "sources": m.get("sources"),
                        "shards": {s["name"]: s.get("sha256") for s in m.get("shards", [])}}
    else:
        card["data"] = {"dir": data_dir, "missing": True}
    if config.get("rl"):
        from lmforge.rl import read_rl_results

        card["rl"] = {**read_rl_results(run), "steps": [{k: r.get(k) for k in _RL_METRICS + ("step",)}
                                                        for r in train if "reward" in r]}
    if samples and steps and (run / "tokenizer.json").is_file():
        card["samples"] = _samples(run, samples)
    return card


_RL_METRICS = ("reward", "reply_tokens", "tool_call_share", "ended_share")
_RL_SCORES = (("greedy_exact_match", "greedy exact match"), ("pass_at_1", "pass@1"), ("pass_at_k", "pass@k"))


def _ci(v: dict[str, Any] | None) -> str:
    """``41.2% [30.1, 52.4]`` from ``{"value", "ci"}`` (an RL score), ``n/a`` without one."""
    if not v:
        return "n/a"
    return f"{100 * v['value']:.1f}% [{100 * v['ci'][0]:.1f}, {100 * v['ci'][1]:.1f}]"


def _rl_section(rep: RunReport, r: dict[str, Any]) -> None:
    """An RL run: per-step reward and reply figures, and the validation scores before and after training."""
    steps = r.get("steps") or []
    rep.section("Reinforcement learning")
    if steps:
        first, last = steps[0], steps[-1]
        rep.table(("per step", f"step {first['step']}", f"step {last['step']}",
                   f"mean of the last {min(10, len(steps))} steps"),
                  [(k.replace("_", " "), _fmt(first.get(k), ".3f"), _fmt(last.get(k), ".3f"),
                    _fmt(sum(s.get(k) or 0 for s in steps[-10:]) / min(10, len(steps)), ".3f")) for k in _RL_METRICS])
    before, after = r.get("before"), r.get("after")
    if not before and not after:
        rep.paragraph("No validation prompts were given (`lmforge rl --val-data FILE.jsonl` scores before and after).")
        return
    ref = after or before
    rep.paragraph(f"Validation prompts: {ref['n']}; pass@k with k = {ref['k']} replies sampled per prompt at the "
                  "rollout temperature (the same seeds before and after); 95% Wilson intervals over prompts.")
    rows = [(label, _ci((before or {}).get(key)), _ci((after or {}).get(key))) for key, label in _RL_SCORES]
    for task in (ref.get("tasks") or {}):
        if len(ref["tasks"]) > 1:
            rows.append((f"{task}: greedy exact match (n={ref['tasks'][task]['n']})",
                         _ci(((before or {}).get("tasks") or {}).get(task, {}).get("greedy_exact_match")),
                         _ci(((after or {}).get("tasks") or {}).get(task, {}).get("greedy_exact_match"))))
    rep.table(("score", f"before (step {(before or {}).get('step', 'n/a')} of the base)",
               f"after (step {(after or {}).get('step', 'n/a')})"), rows)


def _fmt(x: Any, spec: str = ".4f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "n/a"


def _eval_rows(evals: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    rows = []
    for r in evals:
        for key in ("acc", "acc_norm", "acc_bytes", "exact_match", "bpb", "ppl"):
            if r.get(key) is None:
                continue
            ci = r.get(f"{key}_ci")
            value = f"{r[key]:.4f}" + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")
            rows.append((r["task"], key, value, f"{r.get('n', 0):,}", str(r.get("step", "")), r.get("time", "")))
    return rows


def render_run_card(card: dict[str, Any]) -> RunReport:
    """The markdown of a run card from :func:`collect_run_card`'s dict."""
    tr, hw, lm = card["training"], card["hardware"], card["lmforge"]
    rep = RunReport(f"lmforge run card: {card['name']}").paragraph(
        f"Run `{card['run']}`, created {card.get('created') or 'n/a'} by {lm.get('created_by') or 'n/a'}; "
        f"card written by lmforge {lm['version']} (commit `{lm.get('commit') or 'unknown'}`).")
    v = card.get("validation") or {}
    rep.section("Results").table(("metric", "value"), [
        ("checkpoint step", card["checkpoint"]["step"]),
        ("tokens seen", _fmt(tr.get("tokens"), ",")),
        ("last training loss", _fmt(tr.get("last_loss"))),
        ("validation loss / bits per byte", f"{_fmt(v.get('val_loss'))} / {_fmt(v.get('val_bpb'))}"
         + (f" (step {v['step']})" if v.get("step") is not None else "")),
        ("training throughput", f"{_fmt(tr.get('tokens_per_s'), ',.0f')} tokens/s (median of logged intervals)"),
        ("MFU", f"{100 * tr['mfu']:.1f}% ({tr['mfu_basis']})" if tr.get("mfu") else "n/a"),
        ("parameters (matmul weights)", f"{card['model']['matmul_params']:,}"),
        ("base run", json.dumps(card["base_run"]) if card.get("base_run") else "none (pretrained from scratch)"),
    ])
    rep.image("loss curves", "loss.png")
    rows = _eval_rows(card["evals"])
    rep.section("Evals")
    if rows:
        rep.table(("task", "metric", "value [95% Wilson interval]", "items", "step", "when"), rows)
    else:
        rep.paragraph("No evals yet: `lmforge eval RUN --task shakespeare-nextline` (see the README).")
    rep.section("Hardware").paragraph(
        f"{hw['machine']}, {hw['cpu_threads']} CPU threads, torch {hw['torch']}"
        + (f", {hw['cuda']}" if hw.get("cuda") else "")
        + f"; matmul peak {hw['matmul_peak_flops'] / 1e9:,.0f} GFLOP/s ({hw['matmul_peak_source']}; a measurement "
        "on a busy machine reads low).")
    rep.section("Tokenizer and data")
    tok, data = card.get("tokenizer") or {}, card.get("data") or {}
    rep.paragraph(f"Tokenizer fingerprint `{tok.get('fingerprint', 'n/a')}` ({_fmt(tok.get('vocab_size'), ',')} "
                  f"tokens); shards `{data.get('dir')}`"
                  + (" (missing)" if data.get("missing") else f" made with tokenizer `{data['tokenizer_fingerprint']}`"))
    if data.get("kind") in ("conversations", "prompts"):
        rep.table(("split", data["kind"], "tokens", "trained tokens", "source files (SHA-256)"),
                  [(k, _fmt(s.get("conversations"), ","), _fmt(s.get("tokens"), ","), _fmt(s.get("trained_tokens"), ","),
                    ", ".join(f"`{x.get('path')}` `{x.get('sha256')}`" for x in s.get("sources", [])))
                   for k, s in data["splits"].items()])
    elif data.get("splits"):
        rep.table(("split", "tokens", "documents", "text bytes"),
                  [(k, _fmt(s["tokens"], ","), _fmt(s["documents"], ","), _fmt(s["text_bytes"], ","))
                   for k, s in data["splits"].items()])
        rep.table(("shard", "SHA-256"), [(k, f"`{h}`") for k, h in data["shards"].items()])
    if card.get("rl"):
        _rl_section(rep, card["rl"])
    if card.get("samples"):
        rep.section("Samples").paragraph("Temperature 0.8, top-k 50, seed 0, 48 new tokens; prompt in bold.")
        for s in card["samples"]:
            rep.paragraph(f"**{s['prompt']}**").code(s["prompt"] + s["text"], "text")
    rep.section("Configuration").code(dump_yaml(card["config"]).rstrip(), "yaml")
    return rep


def write_run_card(run_dir: str | Path, samples: int = 2) -> Path:
    """Write ``report.md`` and ``report.json`` into a run directory (the run card) and return ``report.md``'s path.

    The card holds the config, lmforge's version and commit, data manifest hashes, the tokenizer fingerprint, the
    base run (when recorded), the hardware and its measured matmul peak, tokens/s and MFU, the loss curves
    (``loss.png``, drawn from ``metrics.jsonl`` when missing), validation loss and bits per byte, every recorded
    eval with its interval (``evals.jsonl``), and ``samples`` generated samples (0: none).
    """
    from lmforge.train.metrics import plot_losses

    run = Path(run_dir)
    card = collect_run_card(run, samples)
    metrics = _read_metrics(run / "metrics.jsonl")
    if metrics and not (run / "loss.png").is_file():
        plot_losses(metrics, run / "loss.png")
    atomic_write_text(run / CARD_JSON, json.dumps(card, indent=1, default=str) + "\n")
    return render_run_card(card).write(run / REPORT_FILE)


def compare_runs(runs: Sequence[str | Path], out: str | Path | None = None, force: bool = False) -> str:
    """A markdown table comparing runs side by side (from their cards, written first if missing).

    ``out``: also write it there (refused if it exists, unless ``force``).
    """
    from lmforge.common import check_output_path

    if out is not None:
        check_output_path(out, force)
    cards = []
    for r in runs:
        p = Path(r) / CARD_JSON
        if not p.is_file():
            write_run_card(r, samples=0)
        cards.append(json.loads(p.read_text(encoding="utf-8")))
    rows: list[list[str]] = [
        ["step", *[str(c["checkpoint"]["step"]) for c in cards]],
        ["tokens seen", *[_fmt(c["training"].get("tokens"), ",") for c in cards]],
        ["parameters", *[f"{c['model']['matmul_params']:,}" for c in cards]],
        ["val loss", *[_fmt((c.get("validation") or {}).get("val_loss")) for c in cards]],
        ["val bits/byte", *[_fmt((c.get("validation") or {}).get("val_bpb")) for c in cards]],
        ["tokens/s", *[_fmt(c["training"].get("tokens_per_s"), ",.0f") for c in cards]],
        ["MFU", *[f"{100 * c['training']['mfu']:.1f}%" if c["training"].get("mfu") else "n/a" for c in cards]],
    ]
    latest: list[dict[tuple[str, str], str]] = []
    for c in cards:  # the newest result of each (task, metric)
        d = {}
        for task, key, value, *_ in _eval_rows(c.get("evals") or []):
            d[(task, key)] = value
        latest.append(d)
    for k in sorted({k for d in latest for k in d}):
        rows.append([f"{k[0]} {k[1]}", *[d.get(k, "n/a") for d in latest]])
    header = ("", *[c["name"] for c in cards])
    rep = RunReport("lmforge runs compared").table(header, rows)
    rep.paragraph("Accuracies with their 95% Wilson interval; each eval's newest result per run.")
    if out is not None:
        rep.write(out)
    return rep.render()
