"""The built-in rewards on hand-made rollouts: ``format`` pays for ``<|assistant_end|>`` alone, ``exact_match``
scores the text after the last calculator output, whitespace stripped at both ends, case kept."""

from __future__ import annotations

import pytest

from lmforge.chat import ChatFormat, add_chat_tokens
from lmforge.rl import Rollout, reward_of
from lmforge.tokenizer import EOT, Tokenizer


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return ChatFormat(add_chat_tokens(Tokenizer({i: bytes([i]) for i in range(256)}, [])))


def _text(s: str) -> list[int]:
    return list(s.encode())  # the byte-level vocabulary: id = byte


def _reply(fmt: ChatFormat, ids: list[int], stop: str | None = "<|assistant_end|>") -> Rollout:
    special = fmt.tokenizer.special_tokens
    return Rollout([1, 2], ids=ids, sampled=[True] * len(ids), stop=None if stop is None else special[stop],
                   finish="length" if stop is None else "stop")


def test_the_format_reward_pays_for_assistant_end_only(fmt) -> None:
    """1 for a reply ended by ``<|assistant_end|>``; 0 for one ended by another stop id (end of text,
    ``<|user_start|>``: the model began a new turn) or by a limit."""
    ids = _text("42")
    assert reward_of("format", fmt, _reply(fmt, ids), "") == 1.0
    for stop in (EOT, "<|user_start|>", None):
        assert reward_of("format", fmt, _reply(fmt, ids, stop), "") == 0.0, stop


def test_exact_match_strips_whitespace_at_both_ends_and_keeps_case(fmt) -> None:
    assert reward_of("exact_match", fmt, _reply(fmt, _text("  7\n")), "7") == 1.0
    assert reward_of("exact_match", fmt, _reply(fmt, _text("7")), " 7 ") == 1.0
    assert reward_of("exact_match", fmt, _reply(fmt, _text("Seven")), "seven") == 0.0
    assert reward_of("exact_match", fmt, _reply(fmt, _text("7 7")), "7") == 0.0


def test_exact_match_scores_the_text_after_the_last_calculator_output(fmt) -> None:
    """A reply that called the calculator is scored on what follows the call's output, not on the whole reply
    (whose decoded text holds the call and its output too); an answer only inside the call scores 0."""
    sp = fmt.tokenizer.special_tokens

    def call(expr: str, out: str) -> list[int]:
        return [sp["<|python_start|>"], *_text(expr), sp["<|python_end|>"], *fmt.tool_output_ids(out)]

    ids = _text("ok ") + call("2*3", "6") + _text(" 6")
    assert reward_of("exact_match", fmt, _reply(fmt, ids), "6") == 1.0
    assert reward_of("exact_match", fmt, _reply(fmt, call("1+1", "2") + call("2*3", "6") + _text("6 ")), "6") == 1.0
    assert reward_of("exact_match", fmt, _reply(fmt, call("2*3", "6") + _text("six")), "6") == 0.0
    assert reward_of("exact_match", fmt, _reply(fmt, call("6", "6")), "6") == 0.0  # nothing after the output


def test_an_unknown_reward_is_refused(fmt) -> None:
    with pytest.raises(ValueError, match="unknown reward 'regex'; the built-in rewards are exact_match, format"):
        reward_of("regex", fmt, _reply(fmt, []), "")
