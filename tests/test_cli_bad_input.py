"""A sweep of bad input over every CLI command: each ends in one line on stderr and exit code 2.

Never a traceback, never a silent wrong result, never a lost file: the files named below are checked to
be untouched after each refused command.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge import cli


@pytest.fixture
def files(tmp_path: Path, tiny_run: Path) -> dict[str, str]:
    (tmp_path / "afile").write_text("x")
    (tmp_path / "latin1.yaml").write_bytes(b"model:\n  name: caf\xe9\n")
    (tmp_path / "broken.yaml").write_text("model: [\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "config.yaml").write_text("mine")
    return {"tmp": str(tmp_path), "run": str(tiny_run), "tok": str(tiny_run / "tokenizer.json"),
            "cfg": str(tiny_run / "config.yaml")}


CASES = [
    # (argv with {placeholders}, stdin, a regex the one line must match)
    ("--no-such-flag train x", None, r"unrecognized arguments: --no-such-flag"),
    ("", None, r"required: COMMAND"),
    ("train", None, r"the following arguments are required: config"),
    ("train {tmp}/nope.yaml", None, r"input file .*nope\.yaml does not exist"),
    ("train {tmp}/latin1.yaml", None, r"latin1\.yaml is not UTF-8 text \(invalid byte at offset 18\)"),
    ("train {tmp}/broken.yaml", None, r"broken\.yaml is not valid YAML at line 2, column 1"),
    ("train {cfg} --set training.max_steps", None, r"must look like section\.key=value"),
    ("train {cfg} --set training.max_stesp=3 --run-dir {tmp}/r", None, r"did you mean 'training\.max_steps'"),
    ("train {cfg} --run-dir {tmp}/afile", None, r"is an existing file, not a directory"),
    ("train {cfg} --run-dir {tmp}/notes", None, r"not an lmforge run directory; .* --force"),
    ("train {cfg} --set model.context_length=1000000000000000 --run-dir {tmp}/r", None,
     r"model\.context_length=1,000,000,000,000,000 is above lmforge's limit of 1,048,576 tokens"),
    ("eval {tmp}/nope", None, r"run directory .*nope does not exist; train one first"),
    ("eval {tmp}/afile", None, r"afile is a file, not a run directory"),
    ("eval {tmp}/notes", None, r"notes is not an lmforge run directory"),
    ("eval {run} --batches 0", None, r"argument --batches: expected a positive integer, got 0"),
    ("eval {run} --batches -1", None, r"expected a positive integer, got -1"),
    ("eval {run} --split nope", None, r"no shards for split 'nope'"),
    ("eval {run} --checkpoint {tmp}/afile", None, r"checkpoint .*afile is truncated"),
    ("generate --run {tmp}/afile --prompt hi", None, r"afile is a file, not a run directory"),
    ("generate --run {tmp}/nope --prompt hi", None, r"does not exist; train one first"),
    ("generate --run {run}", None, r"no prompt given"),
    ("generate --run {run} --prompt ''", None, r"a prompt is empty"),
    ("generate --run {run} --prompt-file {tmp}/empty.txt", None, r"a prompt is empty"),
    ("generate --run {run} --prompt hi --temperature inf", None, r"temperature must be a finite number"),
    ("generate --run {run} --prompt hi --temperature nan", None, r"temperature must be a finite number"),
    ("generate --run {run} --prompt hi --temperature -1", None, r"temperature must be a finite number >= 0"),
    ("generate --run {run} --prompt hi --top-p 0", None, r"top_p must be in \(0, 1\]"),
    ("generate --run {run} --prompt hi --top-k 0", None, r"--top-k: expected a positive integer"),
    ("generate --run {run} --prompt hi --seed 18446744073709551616", None,
     r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\] \(got 18446744073709551616\)"),
    ("generate --run {run} --prompt hi --seed -9223372036854775809", None, r"seed must be an integer in"),
    ("generate --run {run} --prompt hi --max-new-tokens 0", None, r"--max-new-tokens: expected a positive integer"),
    ("generate --run {run} --prompt hi --weight-dtype int3", None, r"invalid choice: 'int3'"),
    ("generate --run {run} --prompt hi --weight-dtype bf16 --activations int8", None,
     r"activations='int8' needs int8 or int4 weights"),
    ("generate --run {run} --prompt hi --device cuda:7", None, r"CUDA is not available|out of range|invalid device"),
    ("generate --run {run} --checkpoint {tmp}/nope.safetensors --prompt hi", None, r"does not exist"),
    ("serve", None, r"the following arguments are required: --run"),
    ("serve --run {tmp}/nope", None, r"does not exist; train one first"),
    ("serve --run {tmp}/afile", None, r"afile is a file, not a run directory"),
    ("serve --run {run} --port 70000", None, r"--port must be in \[0, 65535\]"),
    ("serve --run {run} --max-batch 0", None, r"--max-batch: expected a positive integer, got 0"),
    ("serve --run {run} --max-queue x", None, r"--max-queue: expected a positive integer, got 'x'"),
    ("serve --run {run} --api-key ' '", None, r"--api-key is empty"),
    ("serve --run {run} --api-key 'my key'", None, r"--api-key: the API key holds a space; .*printable ASCII"),
    ("serve --run {run} --api-key clé", None, r"--api-key: the API key holds 'é'"),
    ("serve --run {run} --weight-dtype int4", None, r"invalid choice: 'int4'"),
    ("chat", None, r"give --run DIR to talk to a chat model, or use `lmforge chat render"),
    ("chat --run {run}", "hi", r"is not a chat model: its tokenizer lacks the chat tokens .*lmforge sft --base"),
    ("chat --run {tmp}/nope", "hi", r"does not exist; train one first"),
    ("chat --run {run} --temperature -1", "hi", r"temperature must be a finite number >= 0"),
    ("chat --run {run} --max-new-tokens 0", "hi", r"--max-new-tokens: expected a positive integer"),
    ("chat --run {run} --seed 1180591620717411303424", "hi", r"seed must be an integer in \[-2\*\*63"),
    ("rl", None, r"the following arguments are required: --base, --data, --run-dir"),
    ("rl --base {run} --data {tmp}/afile --run-dir {tmp}/o", None, r"is not a chat model: its tokenizer lacks the "
                                                                     r"chat tokens .*lmforge sft --base"),
    ("rl --base {tmp}/nope --data {tmp}/afile --run-dir {tmp}/o", None, r"does not exist; train one first"),
    ("tokenizer encode --tokenizer {tmp}/afile", "hi", r"afile is not valid JSON"),
    ("tokenizer encode --tokenizer {tmp}/nope.json", "hi", r"does not exist"),
    ("tokenizer decode --tokenizer {tok}", "1.5 2", r"must hold integer ids"),
    ("tokenizer decode --tokenizer {tok}", "[1.0, 2]", r"JSON list must hold integer ids only"),
    ("tokenizer decode --tokenizer {tok}", "-1", r"token id -1 is out of range"),
    ("tokenizer decode --tokenizer {tok}", "400", r"token id 400 is out of range"),
    ("tokenizer stats --tokenizer {tok} {tmp}/nope.txt", None, r"does not exist"),
    ("data get nosuch", None, r"invalid choice: 'nosuch'"),
    ("data inspect {tmp}/afile", None, r"not a shard directory"),
    ("data prepare --tokenizer {tok} --input {tmp}/nope.txt --out {tmp}/o", None, r"does not exist"),
    ("data prepare --tokenizer {tok} --input {tmp}/afile --out {tmp}/o --val-fraction 1.5", None,
     r"val_fraction must be in \[0, 1\)"),
    ("data prepare --tokenizer {tok} --input {tmp}/afile --out {tmp}/o --threads 0", None,
     r"--threads: expected a positive integer"),
    ("data prepare --tokenizer {tok} --input {tmp}/afile --out {tmp}/o --shard-tokens -1", None,
     r"--shard-tokens: expected a positive integer"),
    ("data prepare --tokenizer {tok} --input {tmp}/afile --out {tmp}/afile", None, r"is a file"),
    ("speedrun --budget nonsense --out {tmp}/s", None, r"budget 'nonsense' is not understood"),
    ("speedrun --vocab-size 10 --out {tmp}/s", None, r"vocab_size must be in \[257, 65536\]"),
    ("speedrun --out {tmp}/afile", None, r"is an existing file"),
    ("speedrun --out {tmp}/notes", None, r"is not a speedrun directory"),
    ("speedrun --corpus {tmp}/nope.txt --out {tmp}/s", None, r"does not exist"),
]


@pytest.mark.parametrize("argv, stdin, msg", CASES, ids=[c[0].split(" {")[0] + f"-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_and_exit_2(files, argv, stdin, msg, capsys, monkeypatch) -> None:
    import io
    import re
    import shlex

    tmp = Path(files["tmp"])
    before = {p: p.read_bytes() for p in tmp.rglob("*") if p.is_file()}
    run_before = {p: p.stat().st_mtime_ns for p in Path(files["run"]).rglob("*") if p.is_file()}
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(cli.main(["-q", *shlex.split(argv.format(**files))]))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and re.search(msg, lines[0]), lines[0]
    assert {p: p.read_bytes() for p in before} == before  # nothing lost or changed
    assert {p: p.stat().st_mtime_ns for p in run_before} == run_before
