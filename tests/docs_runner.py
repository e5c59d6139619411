"""Run the commands of a markdown page the way a reader would, fast enough for the suite.

A page's fenced blocks run in order, in one working directory:

* ``bash`` blocks: each command (backslash continuations joined). An ``lmforge ...`` command runs in this process
  through :func:`lmforge.cli.main` (starting a Python with torch per command would cost seconds each), also when
  ``echo``/``printf`` pipes its input; ``lmforge serve ...`` starts a server in the background on a free port,
  which replaces the page's port (``8000``) in every later command and snippet, until the page ends; anything
  else runs under ``bash -c`` with the venv's ``bin/`` first on ``PATH``. Every command must exit with 0.
* ``python`` blocks: executed in one namespace per page.
* ``yaml`` blocks holding run-config sections: a valid run config (over a tiny base for the sections left out).
* ``bash notest`` / ``python notest`` blocks (a GPU, torchrun, the network, or minutes of work): not run, but
  every ``lmforge`` command in them must parse (its subcommand and flags exist), ``make`` targets must exist in
  the Makefile, repository paths they name must exist, and Python must compile.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PAGE_PORT = "8000"
_FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")
_OPERATORS = re.compile(r"[|<>;&$`()]")
_REPO_PATH = re.compile(r"(?<![\w./-])((?:tools|benchmarks|examples|docs|tests)/[\w./-]+)")


@dataclass
class Block:
    """One fenced block: its language, its flags after the language (``notest``), its first line number."""

    path: Path
    line: int
    lang: str
    flags: str
    text: str

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file, in order."""
    out, current, lines = [], None, []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if current is None and m:
            current, lines = (n, m.group(1), m.group(2).strip()), []
        elif current is not None and line.startswith("```"):
            out.append(Block(path, current[0], current[1], current[2], "\n".join(lines) + "\n"))
            current = None
        elif current is not None:
            lines.append(line)
    assert current is None, f"{path}:{current and current[0]}: a fence is never closed"
    return out


def commands(text: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, blank and comment-only lines dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    return out


def lmforge_argv(command: str) -> list[str] | None:
    """The arguments after ``lmforge`` (or ``python -m lmforge.cli``, as torchrun runs it) in ``command``."""
    words = shlex.split(command, comments=True)
    for i, w in enumerate(words):
        if w == "lmforge":
            return words[i + 1:]
        if w == "lmforge.cli" and i and words[i - 1] == "-m":
            return words[i + 1:]
    return None


def check_parses(command: str, where: str) -> None:
    """A command not run: its lmforge flags parse, its make target and repository paths exist."""
    argv = lmforge_argv(command)
    if argv is not None:
        from lmforge.cli import _command_in, build_parser

        only, sub = _command_in(argv)
        assert only, f"{where}: `{command}` names no lmforge command"
        try:
            build_parser(only=only, sub=sub).parse_args(argv)
        except SystemExit as e:
            raise AssertionError(f"{where}: `{command}` does not parse (exit {e.code})") from None
    words = shlex.split(command, comments=True)
    if words[:1] == ["make"]:
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
        for t in (w for w in words[1:] if "=" not in w and not w.startswith("-")):
            assert t in targets, f"{where}: `make {t}`: no such target in the Makefile"
    for p in _REPO_PATH.findall(command):
        assert (ROOT / p).exists(), f"{where}: `{command}` names {p}, which does not exist"


_BASE_CONFIG = {"model": {"vocab_size": 512, "context_length": 128, "d_model": 64, "n_layers": 2, "n_heads": 4},
                "data": {"dir": "data"}}


def check_config(block: Block) -> None:
    """A ``yaml`` block holding run-config sections: every key exists and every value is valid (sections it
    leaves out come from a tiny base config)."""
    import yaml

    from lmforge.train.config import load_run_config

    d = yaml.safe_load(block.text)
    if not isinstance(d, dict) or not {"model", "data", "optimizer", "training"} & set(d):
        return
    merged = {k: {**_BASE_CONFIG.get(k, {}), **v} if isinstance(v, dict) else v for k, v in d.items()}
    try:
        load_run_config(base={**_BASE_CONFIG, **merged})
    except ValueError as e:
        raise AssertionError(f"{block.where}: the config block is not a valid run config: {e}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Page:
    """The state of one page's run: its directory, Python namespace, server and port."""

    cwd: Path
    env: dict[str, str]
    namespace: dict[str, Any] = field(default_factory=dict)
    server: subprocess.Popen | None = None
    port: str = PAGE_PORT
    log: list[str] = field(default_factory=list)
    times: list[tuple[float, str]] = field(default_factory=list)

    def text(self, s: str) -> str:
        return s.replace(PAGE_PORT, self.port)

    # ---- bash
    def run_lmforge(self, argv: list[str], where: str, stdin: str | None = None) -> str:
        from lmforge.cli import main

        out = io.StringIO()
        old_stdin, old_env = sys.stdin, dict(os.environ)
        log = logging.getLogger("lmforge")  # the CLI gives it a handler on this moment's stderr: not for later tests
        old_log = (list(log.handlers), log.level, log.propagate)
        os.environ.update(self.env)
        try:
            sys.stdin = io.StringIO(stdin) if stdin is not None else io.StringIO("")
            with contextlib.chdir(self.cwd), contextlib.redirect_stdout(out):
                rc = main(argv)
        finally:
            sys.stdin = old_stdin
            os.environ.clear()
            os.environ.update(old_env)
            log.handlers[:], log.propagate = old_log[0], old_log[2]
            log.setLevel(old_log[1])
        assert rc == 0, f"{where}: `lmforge {shlex.join(argv)}` exited with {rc}"
        self.log.append(out.getvalue())
        return out.getvalue()

    def start_server(self, command: str, where: str) -> None:
        """``[NAME=value ...] lmforge serve ...`` in the background on a free port, until /health answers."""
        assert self.server is None, f"{where}: a second server on one page"
        words = shlex.split(command, comments=True)
        env = words_env(words)
        words = words[len(env):]
        self.port = str(free_port())
        if "--port" in words:
            words[words.index("--port") + 1] = self.port
        else:
            words += ["--port", self.port]
        argv = [sys.executable, "-m", "lmforge.cli", *words[1:]]
        log = self.cwd / "serve.log"
        with open(log, "w") as f:  # a file, not a pipe nobody reads (a full pipe would stall the server)
            self.server = subprocess.Popen(argv, cwd=self.cwd, env={**os.environ, **self.env, **env},
                                           stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise AssertionError(f"{where}: `{command}` exited: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"{where}: `{command}` did not answer /health within 90 s")

    def run_bash(self, command: str, where: str) -> None:
        env = {**os.environ, **self.env, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        r = subprocess.run(["bash", "-c", "set -eo pipefail\n" + self.text(command)], cwd=self.cwd, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{where}: `{command}` exited with {r.returncode}: {(r.stdout + r.stderr)[-2000:]}"
        self.log.append(r.stdout)

    def run_command(self, command: str, where: str) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        self._run_command(command, where)
        self.times.append((time.perf_counter() - start, f"(cpu {time.process_time() - cpu:5.1f} s) {command[:90]}"))

    def _run_command(self, command: str, where: str) -> None:
        words = shlex.split(command, comments=True)
        plain = words and words[0] == "lmforge" and not _OPERATORS.search(" ".join(words))
        rest = words[len(words_env(words)):]
        if rest[:2] == ["lmforge", "serve"]:
            self.start_server(command, where)
        elif plain:
            self.run_lmforge(words[1:], where)
        elif (m := re.fullmatch(r"(echo|printf) (.+?) \| lmforge (.+)", command.split(" #")[0].strip())) and \
                not _OPERATORS.search(m.group(3)):
            args = shlex.split(m.group(2))
            stdin = " ".join(args) + "\n" if m.group(1) == "echo" else args[0].encode().decode("unicode_escape")
            self.run_lmforge(shlex.split(m.group(3)), where, stdin=stdin)
        else:
            self.run_bash(command, where)

    # ---- python
    def run_python(self, block: Block) -> None:
        code = compile(self.text(block.text), block.where, "exec")
        old_env = dict(os.environ)
        os.environ.update({**self.env, "NO_PROXY": "127.0.0.1,localhost"})
        try:
            with contextlib.chdir(self.cwd), contextlib.redirect_stdout(io.StringIO()):
                exec(code, self.namespace)
        finally:
            os.environ.clear()
            os.environ.update(old_env)

    def stop(self) -> None:
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
            self.server = None


def words_env(words: list[str]) -> dict[str, str]:
    """``NAME=value`` words before the program: the environment a command sets."""
    env = {}
    for w in words:
        if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w):
            name, _, value = w.partition("=")
            env[name] = value
        else:
            break
    return env


def run_page(path: Path, cwd: Path, env: dict[str, str], skip: tuple[str, ...] = ()) -> Page:
    """Run every block of ``path`` in ``cwd`` (blocks whose flags are in ``skip`` are left out)."""
    page = Page(cwd, env)
    try:
        for b in blocks(path):
            if b.flags in skip:
                continue
            if "notest" in b.flags.split():
                if b.lang == "bash":
                    for c in commands(b.text):
                        check_parses(c, b.where)
                elif b.lang == "python":
                    compile(b.text, b.where, "exec")
            elif b.lang in ("bash", "sh", "shell"):
                for c in commands(b.text):
                    page.run_command(c, b.where)
            elif b.lang == "yaml":
                check_config(b)
            elif b.lang == "python":
                start = time.perf_counter()
                page.run_python(b)
                page.times.append((time.perf_counter() - start, f"python block at {b.where}"))
    finally:
        page.stop()
    return page
