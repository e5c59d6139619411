"""Every command in README.md and docs/guide/ runs, on the built-in data shrunk to a tiny corpus, and every link
between the pages resolves.

One module-scoped workspace runs the README's ``bash setup`` blocks once (download, tokenizer, shards, a tiny
pretraining run ``runs/shk``, chat tasks, a fine-tuned ``runs/shk-chat`` and a LoRA ``runs/shk-lora``); each page
then runs in its own copy of it. ``make demo``'s output is stood in for by those runs (``runs/speedrun/{run,sft,rl}``): the demo itself is
``lmforge speedrun``, which tests/test_speedrun.py runs end to end. The Shakespeare download is stood in for by a
synthetic corpus placed in the download cache (``$LMFORGE_CACHE``), so nothing touches the network.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest

from conftest import torch_threads
from docs_runner import ROOT, blocks, run_page

README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs" / "guide").glob("*.md"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def pseudo_corpus(n_docs: int = 300, seed: int = 0) -> str:
    """Documents of ~1,500 pseudo-words (Zipf-distributed, 4-8 letters) joined by ``<|endoftext|>``: enough
    distinct words for the chat tasks, which draw theirs from the corpus."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvw" for v in "aeiou"]
    vocab = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(2, 4)))[:9] for _ in range(1600)})
    weights = [1 / (k + 1) for k in range(len(vocab))]
    docs = []
    for _ in range(n_docs):
        words = rng.choices(vocab, weights, k=rng.randint(20, 60))
        lines = [" ".join(words[i:i + 8]).capitalize() + "." for i in range(0, len(words), 8)]
        docs.append(f"{rng.choice(vocab).upper()}:\n" + "\n".join(lines))
    return "<|endoftext|>".join(docs)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The quick start's files, made by the README's ``bash setup`` blocks."""
    root = tmp_path_factory.mktemp("docs")
    cache = root / "cache"
    (cache / "shakespeare").mkdir(parents=True)
    (cache / "shakespeare" / "shakespeare.txt").write_text(pseudo_corpus(), encoding="utf-8")
    ws = root / "ws"
    ws.mkdir()
    (ws / "examples").symlink_to(ROOT / "examples")  # a reader runs the commands in the repository
    env = {"LMFORGE_CACHE": str(cache)}
    setup = [b for b in blocks(README) if b.flags == "setup"]
    assert setup, "README.md has no ```bash setup block (the quick start the pages build on)"
    with torch_threads(1):  # tiny models: a second thread only spin-waits on a busy machine
        page = run_page(README, ws, env, skip=tuple({b.flags for b in blocks(README)} - {"setup"}))
    assert (ws / "runs/shk/checkpoints").is_dir() and (ws / "runs/shk-chat/checkpoints").is_dir(), page.log
    for name in ("run", "sft", "rl"):  # make demo's runs, stood in for by the quick start's
        shutil.copytree(ws / ("runs/shk" if name == "run" else "runs/shk-chat"), ws / "runs/speedrun" / name)
    _report(page)
    return ws, env


def _report(page) -> None:
    """The slowest commands of a page on stdout (shown with -s): where the suite's seconds go."""
    for seconds, command in sorted(page.times, reverse=True)[:8]:
        print(f"{seconds:6.1f} s  {command}")


def _copy(workspace: tuple[Path, dict[str, str]], tmp_path: Path) -> Path:
    cwd = tmp_path / "ws"
    shutil.copytree(workspace[0], cwd, symlinks=True)
    return cwd


def test_readme_commands_run(workspace, tmp_path):
    with torch_threads(1):
        _report(run_page(README, _copy(workspace, tmp_path), workspace[1], skip=("setup",)))


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.stem)
def test_guide_commands_run(guide, workspace, tmp_path):
    with torch_threads(1):
        _report(run_page(guide, _copy(workspace, tmp_path), workspace[1]))


@pytest.mark.parametrize("block, error", [
    ("```bash\nlmforge data inspect no-such-dir\n```", "exited with 2"),
    ("```bash\nfalse\n```", "exited with 1"),
    ("```bash notest\nlmforge train cfg.yaml --no-such-flag\n```", "does not parse"),
    ("```bash notest\ntorchrun --nproc_per_node=2 -m lmforge.cli trian cfg.yaml\n```", "names no lmforge command"),
    ("```bash notest\nmake no-such-target\n```", "no such target"),
    ("```bash notest\npython benchmarks/bench_nothing.py\n```", "does not exist"),
    ("```python\nraise ValueError('snippet broke')\n```", "snippet broke"),
    ("```yaml\ntraining: {max_step: 10}\n```", "did you mean 'training.max_steps'"),
])
def test_runner_fails_on_what_a_reader_would_stumble_over(block, error, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\n{block}\n", encoding="utf-8")
    with pytest.raises((AssertionError, ValueError), match=error):
        run_page(page, tmp_path, {})


# --------------------------------------------------------------------------------------------------
# Links, anchors, words
# --------------------------------------------------------------------------------------------------
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (duplicates get -1, -2, ...), outside code blocks."""
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no such heading)")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    assert broken_links(page) == []


def test_link_check_sees_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title: one\n## Two, again\n[ok](#title-one) [ok](b.md#two-again-1) "
                                   "[bad](#nope) [bad](c.md) [web](https://x.org/c.md)\n")
    (tmp_path / "b.md").write_text("## Two, again\n## Two, again\n")
    assert broken_links(tmp_path / "a.md") == ["#nope (no such heading)", "c.md (no such file)"]


def test_readme_is_short_and_reaches_a_chat_early():
    text = README.read_text(encoding="utf-8")
    words = len(text.split())
    assert words <= 2500, f"README.md has {words} words; move detail into docs/guide/"
    head = "\n".join(text.splitlines()[:150])
    for needed in ("make demo", "lmforge chat", "lmforge serve", "openai.OpenAI", "lmforge train"):
        assert needed in head, f"README.md's first 150 lines lack `{needed}`"


@pytest.mark.parametrize("page", [README, *GUIDES], ids=lambda p: p.stem)
def test_no_tracker_numbers_in_prose(page):
    assert not re.findall(r"\bissues? #?\d+", page.read_text(encoding="utf-8"), flags=re.IGNORECASE)
