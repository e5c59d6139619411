"""`lmforge export hf|gguf` and `lmforge import hf` end to end, and their bad input: one line, exit code 2,
nothing written."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from lmforge import cli


def _run(argv: str, capsys) -> tuple[int, str, str]:
    code = cli.main(shlex.split(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_export_hf_then_import_hf_then_generate(tiny_run, tmp_path, capsys):
    pytest.importorskip("transformers")
    code, out, err = _run(f"export hf --run {tiny_run} --out {tmp_path}/hf", capsys)
    assert code == 0, err
    assert "AutoModelForCausalLM.from_pretrained" in out and (tmp_path / "hf" / "model.safetensors").is_file()
    code, out, err = _run(f"import hf --model {tmp_path}/hf --out {tmp_path}/run", capsys)
    assert code == 0, err
    code, out, err = _run(f"-q generate --run {tmp_path}/run --prompt 'the' --max-new-tokens 4 --temperature 0 "
                          "--no-stream", capsys)
    assert code == 0 and out.startswith("the"), err


def test_export_hf_force_removes_a_killed_exports_temporaries(tiny_run, tmp_path, capsys):
    """A sharded export killed mid-write leaves lmforge's temporary beside the shards; the next --force export
    removes it (and only lmforge's own: a user's ``.notes.tmp`` stays)."""
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    code, _, err = _run(f"-q export hf --run {tiny_run} --out {out} --max-shard-size 40KB", capsys)
    assert code == 0 and (out / "model.safetensors.index.json").is_file(), err
    stale = out / ".model-00002-of-00003.safetensors.lmforge-0123456789abcdef.tmp"  # what atomic_open names it
    stale.write_bytes(b"half a shard")
    (out / ".notes.tmp").write_text("mine")
    code, _, err = _run(f"-q export hf --run {tiny_run} --out {out} --max-shard-size 40KB --force", capsys)
    assert code == 0, err
    assert not stale.exists() and (out / ".notes.tmp").read_text() == "mine"
    assert not [p for p in out.iterdir() if ".lmforge-" in p.name]


def test_export_gguf(tiny_run, tmp_path, capsys):
    pytest.importorskip("gguf")
    code, out, err = _run(f"export gguf --run {tiny_run} --out {tmp_path}/m.gguf --dtype q8_0", capsys)
    assert code == 0, err
    assert (tmp_path / "m.gguf").read_bytes()[:4] == b"GGUF" and "q8_0" in out


@pytest.fixture
def places(tmp_path: Path, tiny_run: Path) -> dict[str, str]:
    (tmp_path / "afile").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    nockpt = tmp_path / "nockpt"
    nockpt.mkdir()
    for name in ("config.yaml", "tokenizer.json", "lmforge-run.json"):
        (nockpt / name).write_bytes((tiny_run / name).read_bytes())
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (gpt2 / "tokenizer.json").write_text("{}")
    notok = tmp_path / "notok"
    notok.mkdir()
    (notok / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    huge = tmp_path / "huge"  # a context no machine can hold: refused at import, not by every later command
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                  "max_position_embeddings": 1e15}))
    (huge / "tokenizer.json").write_text("{}")
    shutil.copytree(tiny_run, tmp_path / "mine")  # a run of this test's own, for --force onto the source
    hugerun = tmp_path / "hugerun"  # such a run, imported before the bound existed
    shutil.copytree(tiny_run, hugerun)
    (hugerun / "config.yaml").write_text((tiny_run / "config.yaml").read_text().replace(
        "context_length: 32", "context_length: 1000000000000000"))
    return {"tmp": str(tmp_path), "run": str(tiny_run)}


CASES = [
    ("export", r"required: SUBCOMMAND"),
    ("export hf --out {tmp}/o", r"the following arguments are required: --run"),
    ("export hf --run {tmp}/nope --out {tmp}/o", r"run directory .*nope does not exist; train one first"),
    ("export hf --run {tmp}/full --out {tmp}/o", r"full is not an lmforge run directory"),
    ("export hf --run {tmp}/nockpt --out {tmp}/o", r"no checkpoint in .*; train first"),
    ("export hf --run {run} --out {tmp}/full", r"full already exists and is not empty; .* --force"),
    ("export hf --run {run} --out {tmp}/afile", r"afile is an existing file; give a directory path to --out"),
    ("export hf --run {run} --out {tmp}/o --max-shard-size 0", r"expected a positive size"),
    ("export hf --run {run} --out {tmp}/o --max-shard-size lots", r"expected a size such as 500MB"),
    ("export hf --run {run} --out {tmp}/o --checkpoint {tmp}/afile", r"checkpoint .*afile is truncated"),
    ("export gguf --run {run} --out {tmp}/o.gguf --dtype q4_k", r"GGUF dtype 'q4_k' is not supported"),
    ("export gguf --run {run} --out {tmp}/afile", r"afile already exists; pass force=True \(CLI: --force\)"),
    ("export gguf --run {tmp}/nockpt --out {tmp}/o.gguf", r"no checkpoint in"),
    ("import hf --model {tmp}/nope --out {tmp}/o", r"nope is not a directory; give a local HF checkpoint folder"),
    ("import hf --model {tmp}/gpt2 --out {tmp}/o", r"describes GPT2LMHeadModel, not LlamaForCausalLM"),
    ("import hf --model {tmp}/notok --out {tmp}/o", r"notok has no tokenizer.json \(the byte-level BPE tokenizer\)"),
    ("import hf --model {tmp}/full --out {tmp}/o", r"full has no config.json"),
    ("import hf --model {tmp}/gpt2 --out {tmp}/full", r"full already exists and is not empty"),
    ("import hf --model {tmp}/huge --out {tmp}/o", r"max_position_embeddings=1e\+15 is not a context length lmforge "
                                                   r"can hold \(an integer from 1 to 1,048,576\)"),
    # --force never replaces a command's own input: not the source itself, nothing inside it, nothing holding it
    ("export hf --run {tmp}/mine --out {tmp}/mine --force", r"--out .*mine is .*mine, which this command reads: "
                                                           r"writing there \(even with --force\) would replace"),
    ("export hf --run {tmp}/mine --out {tmp}/mine/hf --force", r"--out .*mine/hf is inside .*mine, which this"),
    ("export hf --run {tmp}/mine --out {tmp} --force", r"--out .* holds .*mine, which this command reads"),
    ("export gguf --run {tmp}/mine --out {tmp}/mine/config.yaml --force", r"config\.yaml is inside .*mine, which"),
    ("import hf --model {tmp}/gpt2 --out {tmp}/gpt2 --force", r"--out .*gpt2 is .*gpt2, which this command reads"),
    ("import hf --model {tmp}/gpt2 --out {tmp}/mine --force", r"--out .*mine holds another model's checkpoints "
                                                             r"\(step_00000004\.safetensors"),
    ("export hf --run {tmp}/hugerun --out {tmp}/o", r"model.context_length=1,000,000,000,000,000 is above lmforge's "
                                                    r"limit of 1,048,576 tokens"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(places, argv, message, capsys):
    pytest.importorskip("gguf")
    before = {p: p.read_bytes() for p in Path(places["tmp"]).rglob("*") if p.is_file()}
    try:
        code, _, err = _run(argv.format(**places), capsys)
    except SystemExit as e:  # argparse errors
        code, err = e.code, capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    import re

    assert re.search(message, lines[0]), lines[0]
    assert not Path(places["tmp"], "o").exists() and not Path(places["tmp"], "o.gguf").exists()
    assert {p: p.read_bytes() for p in Path(places["tmp"]).rglob("*") if p.is_file()} == before
