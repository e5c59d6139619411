"""Stage: rl. Reinforcement learning from verifiable rewards: on-policy policy gradient through the one loop.

``rollout`` samples K replies per prompt through the one generation engine (per-row seeds, calculator calls run
as the chat runs them); ``rewards`` holds the built-in rewards (exact match as ``eval --task`` scores it, the
format); ``advantages`` turns rewards into group advantages and rollouts into weighted, masked micro-batches;
``data`` reads and keeps the prompts; ``source`` is the batch source :func:`lmforge.train.train` runs RL with;
``evaluate`` scores greedy exact match, pass@1 and pass@k; ``trainer`` is ``rl()``, what ``lmforge rl`` calls.
"""

from lmforge.rl.advantages import group_advantages, rollout_batches
from lmforge.rl.evaluate import evaluate_policy, pass_at_k
from lmforge.rl.rewards import REWARD_FUNCTIONS, reward_of
from lmforge.rl.rollout import Rollout, rollout_seed, sample_replies
from lmforge.rl.source import RolloutSource, rollout_source
from lmforge.rl.trainer import RESULTS_FILE, RL_DEFAULTS, read_rl_results, rl, rl_config

__all__ = ["REWARD_FUNCTIONS", "RESULTS_FILE", "RL_DEFAULTS", "Rollout", "RolloutSource", "evaluate_policy",
           "group_advantages", "pass_at_k", "read_rl_results", "reward_of", "rl", "rl_config", "rollout_batches",
           "rollout_seed", "rollout_source", "sample_replies"]
