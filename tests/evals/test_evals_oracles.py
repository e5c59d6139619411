"""Independent scorers agree with ``lmforge.evals``: the same task scored through ``transformers``' Llama on the
same weights (per-item log-likelihoods within 1e-4, same accuracies), and through lm-evaluation-harness
(``lm-eval``, offline, a task YAML over a local JSONL) with identical ``acc`` and ``acc_norm``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.evals import ChoiceItem, Task, encode_request, run_task
from lmforge.interop import hf
from lmforge.model import ModelConfig, TransformerLM

transformers = pytest.importorskip("transformers")

ITEMS = [
    ("Question: Which animal sat on the mat?\nAnswer:", [" the cat", " a big happy dog", " the sun"], 0),
    ("The girl said it's a", [" tree", " house", " day", " naïve 世界"], 2),
    ("We'll go to the", [" house.", " mat, and ran to the tree."], 1),
    ("Héllo! The boy was", [" happy", " little", " big"], 1),
    ("It's 2024 and the dog", [" ran", " sat on the mat", " said ok!"], 0),
    ("The day was", [" big", " 3.14", " lowest"], 2),
]


@pytest.fixture(scope="module")
def pair(tiny_tokenizer):
    """A random lmforge model (non-trivial norm gains) and the HF Llama holding the same weights."""
    cfg = ModelConfig(vocab_size=tiny_tokenizer.vocab_size, context_length=64, d_model=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, d_ff=96)
    torch.manual_seed(0)
    ours = TransformerLM(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.uniform_(0.5, 1.5)
    theirs = transformers.LlamaForCausalLM(hf.hf_config(cfg)).eval()
    theirs.load_state_dict(hf.to_hf_state_dict(ours.state_dict(), cfg))
    return ours, theirs


def _task() -> Task:
    return Task("oracle", "choice", [ChoiceItem(tuple((c, x) for x in xs), g) for c, xs, g in ITEMS], "test")


def test_transformers_scores_the_same(pair, tiny_tokenizer):
    ours, theirs = pair
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


def _hf_tokenizer(tok, path: Path):
    """lmforge's tokenizer as a ``PreTrainedTokenizerFast`` that starts every text with the end-of-text token
    (as lmforge starts every context), checked to give lmforge's ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    tok.save_hf(path)
    t = HFTokenizer.from_file(str(path))
    t.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.eot_id)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")
    for ctx, choices, _ in ITEMS:
        for text in (ctx, ctx + choices[-1]):
            assert fast.encode(text) == [tok.eot_id] + tok.encode(text, special="plain")
    return fast


def test_lm_eval_harness_gives_identical_acc_and_acc_norm(pair, tiny_tokenizer, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    ours, theirs = pair
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"context": c, "choices": xs, "gold": g}) + "\n" for c, xs, g in ITEMS))
    (tmp_path / "lmforge_oracle.yaml").write_text(
        "task: lmforge_oracle\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{gold}}'\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    lm = HFLM(pretrained=theirs, tokenizer=_hf_tokenizer(tiny_tokenizer, tmp_path / "tokenizer.json"),
              batch_size=4, device="cpu")
    out = lm_eval.simple_evaluate(model=lm, tasks=["lmforge_oracle"], task_manager=TaskManager(
        include_path=str(tmp_path)), log_samples=True, num_fewshot=0)
    theirs_r = out["results"]["lmforge_oracle"]
    r = run_task(ours, tiny_tokenizer, _task(), batch_size=4, details=True)
    assert r["acc"] == theirs_r["acc,none"] and r["acc_norm"] == theirs_r["acc_norm,none"]
    for sample in out["samples"]["lmforge_oracle"]:  # and every log-likelihood agrees
        their_lls = [float(resp[0]) for resp in sample["filtered_resps"]]
        ours_lls = r["items"][sample["doc_id"]]["lls"]
        assert max(abs(a - b) for a, b in zip(their_lls, ours_lls)) < 1e-4
