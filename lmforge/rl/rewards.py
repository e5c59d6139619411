"""The built-in rewards: a reply's score from a program that checks it. Named, never loaded from user code.

===============  ==============================================================================================
``rl.reward``    reward of one reply
===============  ==============================================================================================
``exact_match``  1 when the reply's final text equals the prompt's answer, exactly as ``lmforge eval --task``
                 scores a chat item (:func:`lmforge.evals.generative.reply_text` and ``is_exact_match``: the text
                 after the last calculator output, whitespace stripped at both ends, case kept), else 0
``format``       1 when the reply ended with ``<|assistant_end|>``, else 0 (a limit, or another stop id)
===============  ==============================================================================================

The names are :data:`lmforge.train.config.REWARDS` (what the config accepts); :data:`REWARD_FUNCTIONS` maps each
to its function.
"""

from __future__ import annotations

from typing import Callable

from lmforge.chat.format import ChatFormat
from lmforge.evals.generative import is_exact_match, reply_text
from lmforge.rl.rollout import Rollout
from lmforge.train.config import REWARDS

__all__ = ["REWARD_FUNCTIONS", "reward_of", "exact_match_reward", "format_reward"]


def exact_match_reward(fmt: ChatFormat, rollout: Rollout, answer: str) -> float:
    """1.0 when the reply's final text is ``answer`` (as ``eval --task`` scores it), else 0.0."""
    return float(is_exact_match(reply_text(fmt, rollout.ids), answer))


def format_reward(fmt: ChatFormat, rollout: Rollout, answer: str) -> float:
    """1.0 when the reply ended with ``<|assistant_end|>``, else 0.0 (``answer`` is not used)."""
    return float(rollout.stop == fmt.assistant_end_id)


REWARD_FUNCTIONS: dict[str, Callable[[ChatFormat, Rollout, str], float]] = {
    "exact_match": exact_match_reward, "format": format_reward}
assert tuple(REWARD_FUNCTIONS) == REWARDS, "every name the config accepts has a function, and no other"


def reward_of(name: str, fmt: ChatFormat, rollout: Rollout, answer: str) -> float:
    """The reward ``name`` (one of :data:`~lmforge.train.config.REWARDS`) of ``rollout`` against ``answer``."""
    if name not in REWARD_FUNCTIONS:
        raise ValueError(f"unknown reward {name!r}; the built-in rewards are {', '.join(REWARDS)}")
    return REWARD_FUNCTIONS[name](fmt, rollout, answer)
