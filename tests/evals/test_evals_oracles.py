"""Independent scorers agree with ``lmforge.evals``: the same task scored through ``transformers``' Llama on the
same weights (per-item log-likelihoods within 1e-4, same accuracies), and through lm-evaluation-harness
(``lm-eval``, offline, a task YAML over a local JSONL) on the folder ``export_hf`` writes, loaded as
``lm_eval --model hf --model_args pretrained=DIR`` loads it (no tokenizer options), with identical
log-likelihoods, ``acc`` and ``acc_norm``, for both choice forms (one context, and Winogrande's contexts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from interop_helpers import make_run
from lmforge.evals import ChoiceItem, Task, encode_request, run_task
from lmforge.interop.hf_export import export_hf
from lmforge.model import ModelConfig

transformers = pytest.importorskip("transformers")

ITEMS = [
    ("Question: Which animal sat on the mat?\nAnswer:", [" the cat", " a big happy dog", " the sun"], 0),
    ("The girl said it's a", [" tree", " house", " day", " naïve 世界"], 2),
    ("We'll go to the", [" house.", " mat, and ran to the tree."], 1),
    ("Héllo! The boy was", [" happy", " little", " big"], 1),
    ("It's 2024 and the dog", [" ran", " sat on the mat", " said ok!"], 0),
    ("The day was", [" big", " 3.14", " lowest"], 2),
]


# Winogrande's form: one context per choice, one shared continuation (contexts of different lengths, so lm-eval's
# acc_norm, which divides by each context's length, can disagree with acc)
WINO = [
    (["The trophy did not fit in the suitcase because the trophy", "The trophy did not fit in the case"],
     " was too big.", 0),
    (["Sam", "The girl who sat on the mat said it's a big day, and the boy"], " ran to the house.", 1),
    (["The sun", "The happy girl said it's a big day and"], " ran.", 0),
    (["A cat", "The big happy dog on the mat"], " said ok.", 1),
    (["Héllo! The boy", "It's 2024 and the little dog"], " was happy.", 0),
    (["We'll go to the house", "The day"], " and the sun was big.", 1),
]


@pytest.fixture(scope="module")
def pair(tiny_tokenizer, tmp_path_factory):
    """A random lmforge run (non-trivial norm gains), its model, and the folder ``export_hf`` makes of it."""
    cfg = ModelConfig(vocab_size=tiny_tokenizer.vocab_size, context_length=64, d_model=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, d_ff=96)
    tmp = tmp_path_factory.mktemp("oracle")
    run, ours = make_run(tmp / "run", tiny_tokenizer, cfg)
    return ours, export_hf(run, tmp / "hf")


def _task() -> Task:
    return Task("oracle", "choice", [ChoiceItem(tuple((c, x) for x in xs), g) for c, xs, g in ITEMS], "test")


def _wino_task() -> Task:
    return Task("wino", "choice", [ChoiceItem(tuple((c, x) for c in cs), g) for cs, x, g in WINO], "test")


def test_transformers_scores_the_same(pair, tiny_tokenizer):
    ours, exported = pair
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    r = run_task(ours, tiny_tokenizer, _task(), batch_size=5, details=True)
    acc = acc_norm = 0
    for (ctx, choices, gold), rec in zip(ITEMS, r["items"]):
        lls = []
        for x in choices:  # one full forward per request through transformers, no cache
            c, cont = encode_request(tiny_tokenizer, ctx, x)
            with torch.no_grad():
                logits = theirs(torch.tensor([c + cont[:-1]])).logits[0, len(c) - 1:]
            lp = torch.log_softmax(logits.double(), -1)
            lls.append(float(lp.gather(1, torch.tensor(cont)[:, None]).sum()))
        assert max(abs(a - b) for a, b in zip(lls, rec["lls"])) < 1e-4
        acc += max(range(len(lls)), key=lambda k: (lls[k], -k)) == gold
        acc_norm += max(range(len(lls)), key=lambda k: (lls[k] / len(choices[k]), -k)) == gold
    assert r["acc"] == acc / len(ITEMS) and r["acc_norm"] == acc_norm / len(ITEMS)


def _yaml(name: str, data: Path, text: str, choice: str, target: str) -> str:
    return (f"task: {name}\n"
            "dataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
            "test_split: test\n"
            "output_type: multiple_choice\n"
            f"doc_to_text: '{text}'\n"
            f"doc_to_choice: '{choice}'\n"
            f"doc_to_target: '{target}'\n"
            "target_delimiter: ''\n"
            "metric_list:\n  - metric: acc\n  - metric: acc_norm\n  - metric: acc_bytes\n")


def test_lm_eval_on_the_exported_folder_gives_identical_scores(pair, tiny_tokenizer, tmp_path):
    """``lm_eval --model hf --model_args pretrained=DIR``: lm-eval's own tokenizer handling (no wrapper, no
    ``add_bos_token``) conditions on ``<|endoftext|>`` because the export says so, as lmforge does. Winogrande's
    form is lm-eval's multiple-input task (``doc_to_text`` the gold index, ``doc_to_choice`` the contexts).
    ``logits_cache=False``: lm-eval 0.4.13's default cache mis-scores a request whose tokens prefix another's
    (EleutherAI/lm-evaluation-harness#2984). ``include_defaults=False``: only our two tasks are indexed, not
    lm-eval's ~15,000 built-in YAMLs (seconds of parsing)."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    ours, exported = pair
    data, wino = tmp_path / "items.jsonl", tmp_path / "wino.jsonl"
    data.write_text("".join(json.dumps({"context": c, "choices": xs, "gold": g}) + "\n" for c, xs, g in ITEMS))
    wino.write_text("".join(json.dumps({"contexts": cs, "continuation": x, "gold": g}) + "\n" for cs, x, g in WINO))
    (tmp_path / "lmforge_oracle.yaml").write_text(
        _yaml("lmforge_oracle", data, "{{context}}", "{{choices}}", "{{gold}}"))
    (tmp_path / "lmforge_wino.yaml").write_text(
        _yaml("lmforge_wino", wino, "{{gold}}", "{{contexts}}", "{{continuation}}"))
    out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={exported},logits_cache=False",
                                  tasks=["lmforge_oracle", "lmforge_wino"], batch_size=4, device="cpu",
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                                  log_samples=True, num_fewshot=0)
    for name, task in (("lmforge_oracle", _task()), ("lmforge_wino", _wino_task())):
        theirs = out["results"][name]
        r = run_task(ours, tiny_tokenizer, task, batch_size=4, details=True)
        for sample in out["samples"][name]:  # every log-likelihood agrees
            their_lls = [float(resp[0]) for resp in sample["filtered_resps"]]
            ours_lls = r["items"][sample["doc_id"]]["lls"]
            assert max(abs(a - b) for a, b in zip(their_lls, ours_lls)) < 1e-4, name
        for metric in ("acc", "acc_norm", "acc_bytes"):
            assert r[metric] == theirs[f"{metric},none"], (name, metric)
    assert r["acc"] != r["acc_norm"]  # on these items the Winogrande acc_norm is not acc in disguise
