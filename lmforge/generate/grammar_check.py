"""A sacrificial process that compiles each new grammar first, so a grammar that crashes llguidance (a native
stack overflow, an abort) or compiles past a deadline costs that process and one request, never the server.

:class:`GrammarCheck` (the server's side) starts ``python -I grammar_check.py`` (this file as a script: the child
imports the standard library and llguidance only, not lmforge or torch, and starts in a fraction of a second),
hands it the vocabulary once, then one grammar at a time. The child compiles it with llguidance's
:data:`LIMITS`, on a thread with a :data:`STACK_BYTES` stack (smaller than any thread the server compiles on,
so what survives here survives there), then walks up to ``probe`` tokens (the lowest allowed id each step), so
that errors llguidance finds only while decoding (a parser row over its item limit) show up now; it answers
``{"ok": true}`` or ``{"error": "one line"}``. A child that dies or does not answer within the deadline is
killed and restarted; that grammar is refused, saying which.

Protocol: JSON lines. Parent -> child: ``{"tokens": [hex, ...], "special": [id, ...], "end": id}`` once, then
``{"grammar": text, "probe": n}``; child -> parent: ``{"ready": true}`` once, then one answer per grammar.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["GrammarCheck", "LIMITS", "NICE", "STACK_BYTES", "lower_priority"]

LIMITS: dict[str, Any] = {"verbose_errors": False}
"""``llguidance.LLParserLimits`` arguments for every compile (here and in the server): errors name the problem
without echoing the grammar or the parser's state (hundreds of KB on a large schema)."""

STACK_BYTES = 1 << 20
"""The child's compile thread stack: 1 MiB (llguidance's recursive compile overflows ~8 MiB at a chain of
~2,500 ``$ref``s or ~1,100 nested arrays, 1 MiB at ~300 / ~140; the schema limits stop far below either)."""

NICE = 10
"""How much lower than the server's the scheduling priority of every grammar compile is (the child process and
the server's own compile thread): on a busy machine a long compile yields the cores to the event loop and the
decoding threads instead of taking them (a compile only delays its own request)."""

START_TIMEOUT_S = 60.0
MAX_MESSAGE = 300  # characters of an error kept (one line)


def lower_priority(thread: bool = False) -> None:
    """Lower this process's scheduling priority by :data:`NICE` (``thread=True``: only the calling thread's, which
    Linux allows; elsewhere nothing). Best effort: where the system refuses, priorities stay as they were."""
    try:
        if not thread:
            os.nice(NICE)
        elif sys.platform.startswith("linux"):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICE)
    except OSError:
        pass


def one_line(message: str, limit: int = MAX_MESSAGE) -> str:
    """``message``'s first line, at most ``limit`` characters (an error never repeats a whole grammar)."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return first if len(first) <= limit else first[: limit - 3] + "..."


class GrammarCheck:
    """The server's handle on the child (see the module docstring). Thread-safe: one grammar at a time.

    ``tokens``: each id's bytes (the vocabulary as llguidance sees it, the "may end here" id included);
    ``special``: the ids no grammar text may contain; ``end``: the "may end here" id. ``timeout``: seconds one
    grammar may take (compile and probe) before the child is killed. ``started``: children started so far.
    """

    def __init__(self, tokens: list[bytes], special: list[int], end: int, timeout: float = 10.0,
                 probe: int = 16) -> None:
        self._init = (json.dumps({"tokens": [t.hex() for t in tokens], "special": special, "end": end}) + "\n").encode()
        self.timeout, self.probe = timeout, probe
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self.started = 0

    def check(self, grammar: str) -> str | None:
        """None when ``grammar`` compiles and survives the probe in the child, else why not (one line)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._write((json.dumps({"grammar": grammar, "probe": self.probe}) + "\n").encode())
                answer = self._read(self.timeout)
            except TimeoutError:
                self._kill()
                return f"compiling it took over {self.timeout:g} s, this server's limit"
            except (OSError, EOFError):
                code = self._kill()
                how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
                return f"it crashed the grammar compiler ({how}); simplify it"
            return None if answer.get("ok") else one_line(str(answer.get("error")))

    def close(self) -> None:
        """Stop the child (a later :meth:`check` starts a new one)."""
        with self._lock:
            self._kill()

    # ---------------------------------------------------------------------------------------------
    def _start(self) -> None:
        self._kill()
        self._proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._buf = b""
        self.started += 1
        try:
            self._write(self._init)
            if not self._read(START_TIMEOUT_S).get("ready"):
                raise OSError("the grammar check process did not start")
        except (OSError, EOFError, TimeoutError) as e:
            self._kill()
            raise RuntimeError(f"the grammar check process did not start: {e}") from None

    def _kill(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()
        return code

    def _write(self, data: bytes) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(data)
        self._proc.stdin.flush()

    def _read(self, timeout: float) -> dict[str, Any]:
        """The child's next answer line; TimeoutError after ``timeout`` s, EOFError if it died."""
        assert self._proc is not None and self._proc.stdout is not None
        fd, deadline = self._proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            data = os.read(fd, 1 << 16)
            if not data:
                raise EOFError
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)


# --------------------------------------------------------------------------------------------------
# The child
# --------------------------------------------------------------------------------------------------
def _probe(llg: Any, lltok: Any, grammar: str, steps: int, end: int) -> dict[str, Any]:
    m = llg.LLMatcher(lltok, grammar, log_level=0, limits=llg.LLParserLimits(**LIMITS))
    if m.is_error():
        return {"error": m.get_error()}
    for _ in range(steps):
        mask = m.compute_bitmask()
        if m.is_error():
            return {"error": m.get_error()}
        allowed = int.from_bytes(mask, "little")
        if not allowed:
            return {"error": "the grammar allows no next token"}
        low = (allowed & -allowed).bit_length() - 1  # the lowest allowed id
        if low == end:
            break
        if not m.consume_token(low):
            return {"error": m.get_error()}
    return {"ok": True}


def _main() -> None:
    import llguidance as llg

    lower_priority()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    init = json.loads(stdin.readline())
    vocab = [bytes.fromhex(h) for h in init["tokens"]]
    single = {t[0]: i for i, t in enumerate(vocab) if len(t) == 1 and i not in set(init["special"])}

    class Vocabulary:  # what llguidance.TokenizerWrapper reads
        eos_token_id, bos_token_id, tokens = init["end"], None, vocab
        special_token_ids = sorted(set(init["special"]))

        def __call__(self, text: bytes | str) -> list[int]:  # only for llguidance's helpers: byte tokens
            data = text.encode() if isinstance(text, str) else text
            return [single[b] for b in data if b in single]

    lltok = llg.LLTokenizer(llg.TokenizerWrapper(Vocabulary()), n_vocab=len(vocab))

    def reply(obj: dict[str, Any]) -> None:
        stdout.write((json.dumps(obj) + "\n").encode())
        stdout.flush()

    threading.stack_size(STACK_BYTES)
    reply({"ready": True})
    with ThreadPoolExecutor(1) as compiler:  # its thread has the small stack
        for line in stdin:
            req = json.loads(line)
            try:
                out = compiler.submit(_probe, llg, lltok, req["grammar"], int(req["probe"]), init["end"]).result()
            except Exception as e:  # noqa: BLE001  (an API-level refusal: say it)
                out = {"error": f"{type(e).__name__}: {e}"}
            reply({"error": one_line(str(out["error"]))} if "error" in out else {"ok": True})


if __name__ == "__main__":
    _main()
