"""Progress output: a bar on a terminal, plain periodic lines in a file (never a ``\\r``), nothing when quiet.

The end-to-end tests run the real CLI (tokenizer train, data prepare, train) with stderr redirected to a file,
and in a pseudo-terminal.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import yaml
from tqdm import tqdm

from conftest import make_documents
from lmforge.progress import LineProgress, progress

_CLI = "import sys; from lmforge.cli import main; sys.exit(main(sys.argv[1:]))"
_BAR_REDRAW = re.compile(r"\r(?!\n)")  # a carriage return that is not part of a pty's \r\n line ending


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lmforge"]


# --------------------------------------------------------------------------------------------------
# The plain-line reporter and the one decision
# --------------------------------------------------------------------------------------------------
def test_line_progress_logs_first_update_then_every_period_then_close(caplog) -> None:
    clock = _Clock()
    with caplog.at_level(logging.INFO, logger="lmforge"):
        p = LineProgress(100, "train", "step", every=5.0, clock=clock)
        clock.t = 1.0
        p.update(10)  # first update: a line at once
        clock.t = 3.0
        p.update(10)  # 2 s later: quiet
        p.set_postfix({"loss": "3.2100", "lr": "1.00e-03"}, refresh=False)
        clock.t = 6.0
        p.update(20)  # 5 s after the last line: a line
        clock.t = 8.0
        p.update(10)
        p.close()  # the last figures are always logged
        p.close()
    assert _lines(caplog) == [
        "train: 10/100 step (10%), 10 step/s, eta 0:00:09",
        "train: 40/100 step (40%), 6.67 step/s, eta 0:00:09, loss=3.2100, lr=1.00e-03",
        "train: 50/100 step (50%), 6.25 step/s, eta 0:00:08, loss=3.2100, lr=1.00e-03",
    ]


def test_line_progress_bytes_unknown_total_and_resumed_start(caplog) -> None:
    clock = _Clock()
    with caplog.at_level(logging.INFO, logger="lmforge"):
        with LineProgress(None, "counting", "B", every=0.0, clock=clock) as p:
            clock.t = 2.0
            p.set_postfix_str("12,000 tok/s")
            p.update(3 << 20)
            p.set_postfix_str("13,000 tok/s")  # changed after the last line: logged on close
        resumed = LineProgress(10, "train", "step", initial=4, every=0.0, clock=clock)
        resumed.close()  # nothing happened in this session: no line
        clock.t = 3.0
        LineProgress(10, "quiet", "step", enabled=False, every=0.0, clock=clock).update(5)
    assert _lines(caplog) == ["counting: 3.0 MiB, 1.5 MiB/s, 12,000 tok/s",
                              "counting: 3.0 MiB, 1.5 MiB/s, 13,000 tok/s"]


def test_progress_picks_a_bar_only_on_a_terminal(monkeypatch) -> None:
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setattr(logging.getLogger("lmforge"), "level", logging.NOTSET)
    tty = _TTY()
    monkeypatch.setattr(sys, "stderr", tty)
    bar = progress(8, "train", "step")
    assert isinstance(bar, tqdm)
    bar.update(8)
    bar.close()
    assert "\r" in tty.getvalue() and "8/8" in tty.getvalue()

    assert isinstance(progress(8, "train", "step", enabled=False), LineProgress)
    monkeypatch.setenv("TQDM_DISABLE", "1")  # on a terminal: the plain lines instead of the bar
    line = progress(8, "train", "step")
    assert isinstance(line, LineProgress) and not line.disable
    monkeypatch.delenv("TQDM_DISABLE")
    monkeypatch.setattr(logging.getLogger("lmforge"), "level", logging.WARNING)  # the CLI's --quiet
    assert progress(8, "train", "step").disable

    monkeypatch.setattr(logging.getLogger("lmforge"), "level", logging.NOTSET)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # redirected
    assert isinstance(progress(8, "train", "step"), LineProgress)
    monkeypatch.setitem(sys.modules, "ipykernel", sys)  # in a Jupyter kernel: tqdm.auto's widget or bar
    bar = progress(8, "train", "step")
    assert isinstance(bar, tqdm)
    bar.close()


def test_bad_period_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("LMFORGE_PROGRESS_SECONDS", "often")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with pytest.raises(ValueError, match="LMFORGE_PROGRESS_SECONDS='often' is not a number"):
        progress(8, "train", "step")


def test_no_tqdm_call_outside_the_helper() -> None:
    package = Path(__file__).parents[1] / "lmforge"
    users = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if "tqdm" in p.read_text())
    assert users == ["progress.py"]


# --------------------------------------------------------------------------------------------------
# The real commands, stderr in a file and in a pseudo-terminal
# --------------------------------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "LMFORGE_PROGRESS_SECONDS")}
    env.update(extra)
    return env


def _run_to_file(args: list[str], log: Path, **env: str) -> str:
    with open(log, "wb") as err:
        proc = subprocess.run([sys.executable, "-c", _CLI, *args], stdout=subprocess.DEVNULL, stderr=err,
                              env=_env(**env), timeout=240)
    text = log.read_text(encoding="utf-8")
    assert proc.returncode == 0, text
    return text


def _run_in_pty(args: list[str], **env: str) -> str:
    """Run the CLI with stdout and stderr on a 100-column pseudo-terminal; return everything it printed."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", _CLI, *args], stdout=slave, stderr=slave, env=_env(**env))
    os.close(slave)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 240)
            assert ready, "no output from the command for 240 s"
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=60) == 0, out.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return out.decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("progress")
    corpus = d / "corpus.txt"
    corpus.write_text("<|endoftext|>".join(make_documents(300, seed=3)), encoding="utf-8")
    cfg = {"model": {"vocab_size": 320, "context_length": 32, "d_model": 32, "n_layers": 2, "n_heads": 2},
           "optimizer": {"lr": 3e-3, "warmup_steps": 2},
           "training": {"max_steps": 8, "batch_size": 4, "device": "cpu", "log_every": 2, "eval_every": 4,
                        "eval_batches": 1, "checkpoint_every": 8, "num_threads": 1},
           "data": {"dir": str(d / "shards")}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return {"dir": d, "corpus": corpus, "tok": d / "tok.json", "shards": d / "shards", "cfg": d / "cfg.yaml"}


@pytest.fixture(scope="module")
def file_logs(work) -> dict[str, str]:
    """stderr of tokenizer train, data prepare and train, each redirected to a file (a line per update)."""
    d = work["dir"]
    fast = {"LMFORGE_PROGRESS_SECONDS": "0"}
    return {
        "tokenizer": _run_to_file(["tokenizer", "train", "--input", str(work["corpus"]), "--vocab-size", "300",
                                   "--special-token", "<|endoftext|>", "--out", str(work["tok"])],
                                  d / "tok.log", **fast),
        "prepare": _run_to_file(["data", "prepare", "--tokenizer", str(work["tok"]), "--input", str(work["corpus"]),
                                 "--out", str(work["shards"]), "--val-fraction", "0.1"], d / "prepare.log", **fast),
        "train": _run_to_file(["train", str(work["cfg"]), "--run-dir", str(d / "run")], d / "train.log", **fast),
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_logs_in_a_file_are_plain_periodic_lines(file_logs) -> None:
    for name, text in file_logs.items():
        assert "\r" not in text, f"{name}: carriage return in a redirected log:\n{text}"
    assert re.search(r"INFO counting: [\d.]+ KiB/[\d.]+ KiB \(\d+%\)", file_logs["tokenizer"])
    assert re.search(r"INFO merges: \d+/\d+ merge \(\d+%\)", file_logs["tokenizer"])
    assert re.search(r"INFO prepare shards: .*tok/s", file_logs["prepare"])
    steps = re.findall(r"INFO train: (\d)/8 step \(\d+%\), [\d.]+ step/s.*loss=[\d.]+, lr=[\d.e+-]+, tok/s=",
                       file_logs["train"])
    assert steps and steps[-1] == "8" and len(steps) >= 3, file_logs["train"]  # periodic, and the last step
    assert "eta 0:" in file_logs["train"]


def test_quiet_and_no_progress_show_no_progress(work, file_logs, capsys, monkeypatch) -> None:
    """In this process (stderr captured, not a terminal, as in a redirected file): the flags, not the stream."""
    from lmforge.cli import main

    monkeypatch.setenv("LMFORGE_PROGRESS_SECONDS", "0")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert main(["-q", "train", str(work["cfg"]), "--run-dir", str(work["dir"] / "quiet")]) == 0
    assert capsys.readouterr().err == ""
    assert main(["train", str(work["cfg"]), "--run-dir", str(work["dir"] / "nobar"), "--no-progress"]) == 0
    text = capsys.readouterr().err
    assert "training " in text and "train: " not in text and "\r" not in text
    assert main(["train", str(work["cfg"]), "--run-dir", str(work["dir"] / "lines")]) == 0
    assert "INFO train: 8/8 step (100%)" in capsys.readouterr().err  # the same capture shows them without the flag


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_terminal_gets_the_bar_unless_tqdm_disable(work, file_logs) -> None:
    out = _run_in_pty(["train", str(work["cfg"]), "--run-dir", str(work["dir"] / "tty")])
    assert _BAR_REDRAW.search(out) and re.search(r"train: 100%\|.*\| 8/8 ", out), out
    out = _run_in_pty(["train", str(work["cfg"]), "--run-dir", str(work["dir"] / "tty-off")], TQDM_DISABLE="1",
                      LMFORGE_PROGRESS_SECONDS="0")
    assert not _BAR_REDRAW.search(out) and "INFO train: 8/8 step (100%)" in out, out
