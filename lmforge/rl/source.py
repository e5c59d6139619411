"""RL inside the one training loop: a batch source whose batches are the step's rollouts.

:func:`rollout_source` is what ``lmforge rl`` passes to :func:`lmforge.train.train` as ``source``; the loop opens
the run's prompts with it and then treats :class:`RolloutSource` as any loader: it calls ``next_batch()`` for each
micro-batch of a step, checkpoints ``state_dict()``, and logs ``step_metrics()`` beside the loss. What happens in
a step ``s``, on every rank:

1. The first ``next_batch()`` of the step picks the step's ``rl.prompts_per_step`` prompts (global slots
   ``s·P .. s·P + P - 1`` of a seeded shuffle per epoch, as the conversation loader orders conversations) and
   takes this rank's share: ``P / world size`` consecutive slots.
2. A new :class:`~lmforge.generate.engine.Engine` packs the model's current weights (the ones the previous
   step's update left), and every ``rl.prompts_per_decode`` prompts of the share are decoded together
   (:func:`~lmforge.rl.rollout.sample_replies`), ``K = rl.samples_per_prompt`` rows each, reply ``k`` to slot ``j``
   seeded with :func:`~lmforge.rl.rollout.rollout_seed` ``(training.seed, s, j, k)``. The decode batches are
   whole chunks of the global slots, so a reply is the same at any world size whatever the decode kernels do
   with a batch's other rows (only ``prompts_per_decode`` must divide the share).
3. Rewards (:mod:`lmforge.rl.rewards`), group advantages and, with ``rl.kl_coef``, the KL term per token
   (:mod:`lmforge.rl.advantages`); the rollouts become ``(x, y, weights)`` micro-batches. The step's metrics
   (mean reward, reply length, tool-call share, ended share) are summed over ranks.
4. The loop's masked, weighted loss over the global count of sampled tokens, backward, update.

Every log-probability the update takes (the loss's, and the KL term's of the policy and of the reference) is
the one of the distribution the rollouts sampled from: the logits divided by ``rl.temperature``
(:meth:`RolloutSource.tempered`), so the step is the policy gradient of the policy that sampled. Top-k/top-p
truncation, when set, is not in it (the log-probability is over the whole vocabulary, as is usual).

Everything a step draws comes from its seeds, so the loader's state is the number of steps taken: a run killed
anywhere resumes from its last checkpoint and samples, scores and trains exactly as one that never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Iterator

import torch

from lmforge.chat.format import ChatFormat
from lmforge.data.conversations import IGNORE_INDEX, ConversationDataset, epoch_order
from lmforge.generate.engine import Engine
from lmforge.rl.advantages import group_advantages, rollout_batches
from lmforge.rl.data import PromptSet, load_prompts
from lmforge.rl.rewards import reward_of
from lmforge.rl.rollout import Rollout, rollout_seed, sample_replies
from lmforge.train.distributed import all_reduce_sum
from lmforge.tokenizer import EOT
from lmforge.train.finetune import build_model

logger = logging.getLogger("lmforge")

__all__ = ["RolloutSource", "rollout_source", "step_prompts", "tempered_logits"]

STATE_VERSION = 1


def step_prompts(n: int, seed: int, step: int, per_step: int) -> list[int]:
    """Indices (into ``n`` prompts) of the global slots ``0 .. per_step - 1`` of ``step``: slot ``j`` is position
    ``(step·per_step + j) mod n`` of epoch ``(step·per_step + j) div n``'s seeded order."""
    out, orders = [], {}
    for j in range(per_step):
        g = step * per_step + j
        epoch, pos = divmod(g, n)
        if epoch not in orders:
            orders[epoch] = epoch_order(n, seed, epoch)
        out.append(int(orders[epoch][pos]))
    return out


@contextlib.contextmanager
def tempered_logits(temperature: float, *models: Any) -> Iterator[None]:
    """Inside, each bare ``TransformerLM`` of ``models`` computes its logits (and so its loss) divided by
    ``temperature`` after everything else the head applies (the soft-cap): what the sampler does with the engine's
    logits (``TransformerLM.logit_temperature``). Nothing changes at temperature 1."""
    before = [m.logit_temperature for m in models]
    for m in models:
        m.logit_temperature = temperature
    try:
        yield
    finally:
        for m, t in zip(models, before):
            m.logit_temperature = t


class RolloutSource:
    """The loader of an RL run (see the module docstring); ``bind(model)`` before the first ``next_batch``."""

    masked = True  # targets hold IGNORE_INDEX (the prompt, a tool's output, padding)

    def __init__(self, cfg: Any, prompts: PromptSet, fmt: ChatFormat, info: Any, micro_batch: int) -> None:
        rl, W = cfg.rl, info.world_size
        if cfg.training.global_batch_size != rl.prompts_per_step * rl.samples_per_prompt:
            raise ValueError(f"training.global_batch_size={cfg.training.global_batch_size} must be rl.prompts_per_step "
                             f"x rl.samples_per_prompt = {rl.prompts_per_step * rl.samples_per_prompt} (the replies of "
                             "one step); `lmforge rl` sets it")
        if cfg.training.parallel == "fsdp" and info.enabled:
            raise ValueError("rl with training.parallel=fsdp: every rank samples its rollouts from the whole model, "
                             "which FSDP shards; use training.parallel=ddp")
        if rl.prompts_per_step % W:
            raise ValueError(f"rl.prompts_per_step={rl.prompts_per_step} cannot be split over {W} processes by whole "
                             f"prompts; use a world size that divides it")
        self.local = rl.prompts_per_step // W  # prompts of this rank per step
        if self.local % rl.prompts_per_decode:
            raise ValueError(f"rl.prompts_per_decode={rl.prompts_per_decode} must divide the {self.local} prompts each "
                             f"of {W} processes samples per step (rl.prompts_per_step / world size)")
        self.cfg, self.rl, self.prompts, self.fmt, self.info = cfg, rl, prompts, fmt, info
        self.micro_batch = micro_batch
        self.step = 0  # steps whose rollouts were drawn
        self.model: Any = None
        self.ref: Any = None  # the starting model, for the KL penalty
        self._queue: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._metrics: dict[str, float] = {}
        self.last_rollouts: list[Rollout] = []  # this rank's rollouts of the last step (for tests and benchmarks)

    # ---- the loop's loader interface ---------------------------------------------------------------
    def bind(self, model: Any) -> None:
        """The bare model being trained: rollouts sample from its weights as they are at each step."""
        self.model = model
        if self.rl.kl_coef > 0 and self.ref is None:
            # its initialisation draws from torch's RNG, which a resumed run has just restored: fork it, so the
            # training's random numbers (LoRA dropout) are those of a run that never stopped
            cuda = [self.info.device] if self.info.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
                self.ref = build_model(dataclasses.replace(self.cfg, lora=None), self.info.device,
                                       resuming=False).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)

    def tempered(self) -> contextlib.AbstractContextManager:
        """The loop runs the loss's forward inside this: the bound model's logits divided by ``rl.temperature``,
        the distribution the rollouts were sampled from (see the module docstring)."""
        return tempered_logits(self.rl.temperature, self.model)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next ``(x, y, weights)`` micro-batch; the first of a step draws the step's rollouts."""
        if not self._queue:
            assert self.model is not None, "bind(model) before the first batch"
            self._queue = self._draw(self.step)
            self.step += 1
        return self._queue.pop(0)

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "kind": "rollouts", "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION or state.get("kind") != "rollouts":
            raise ValueError(f"the checkpoint's loader state is not an RL run's ({state.get('kind')!r}); resume it "
                             "with the command that started it")
        self.step, self._queue = int(state["step"]), []

    def step_metrics(self) -> dict[str, float]:
        """The last step's figures over every rank (logged beside its loss)."""
        return dict(self._metrics)

    # ---- one step's rollouts ------------------------------------------------------------------------
    def _draw(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        rl, model, t0 = self.rl, self.model, time.perf_counter()
        slots = range(self.info.rank * self.local, (self.info.rank + 1) * self.local)
        index = step_prompts(len(self.prompts), self.cfg.training.seed, step, rl.prompts_per_step)
        was = model.training
        model.eval()
        try:
            engine = Engine(model)  # packs the weights as they are now (after the previous step's update)
            rollouts, rewards = [], []
            for c in range(0, self.local, rl.prompts_per_decode):
                chunk = list(slots)[c: c + rl.prompts_per_decode]
                seeds = [[rollout_seed(self.cfg.training.seed, step, j, k) for k in range(rl.samples_per_prompt)]
                         for j in chunk]
                groups = sample_replies(engine, [self.prompts.ids[index[j]] for j in chunk], seeds,
                                        temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p,
                                        max_new_tokens=rl.max_new_tokens, fmt=self.fmt,
                                        vocab_limit=self.fmt.tokenizer.vocab_size, tools=rl.tools)
                for j, group in zip(chunk, groups):
                    answer = self.prompts.items[index[j]].answer
                    rollouts.extend(group)
                    rewards.append([reward_of(rl.reward, self.fmt, r, answer) for r in group])
            del engine
            adv = group_advantages(torch.tensor(rewards), rl.std_advantages).reshape(-1).tolist()
            weights = [[a] * (len(r.ids) + (r.stop is not None)) for r, a in zip(rollouts, adv)]
            T, pad = self.cfg.context_length, self.fmt.ids[EOT]
            batches = rollout_batches(rollouts, weights, self.micro_batch, T, pad)
            kl = self._kl_weights(batches) if rl.kl_coef > 0 else None
        finally:
            model.train(was)
        self.last_rollouts = rollouts
        self._metrics = self._reduce(rollouts, rewards, kl, time.perf_counter() - t0)
        return batches

    @torch.no_grad()
    def _kl_weights(self, batches: list) -> tuple[float, float]:
        """Subtract ``kl_coef · (log p - log p_ref)`` of each sampled token from its weight, in place (both at
        the sampling temperature); returns ``(sum of the log-ratios, count)`` for the log."""
        device, total, count = self.info.device, 0.0, 0
        for x, y, w in batches:
            x, y = x.to(device), y.to(device)
            with tempered_logits(self.rl.temperature, self.model, self.ref):
                lp = -self.model(x, targets=y, ignore_index=IGNORE_INDEX, reduction="none").view(y.shape)  # (B, T)
                ref = -self.ref(x, targets=y, ignore_index=IGNORE_INDEX, reduction="none").view(y.shape)
            ratio = ((lp - ref) * (y != IGNORE_INDEX)).cpu()
            w.sub_(self.rl.kl_coef * ratio)
            total, count = total + float(ratio.sum()), count + int((y != IGNORE_INDEX).sum())
        return total, count

    def _reduce(self, rollouts: list[Rollout], rewards: list[list[float]], kl: tuple[float, float] | None,
                seconds: float) -> dict[str, float]:
        """The step's metrics summed over ranks (every rank calls this once per step)."""
        end = self.fmt.assistant_end_id
        local = [float(sum(map(sum, rewards))), float(len(rollouts)), float(sum(r.sampled_count for r in rollouts)),
                 float(sum(r.tool_calls > 0 for r in rollouts)), float(sum(r.stop == end for r in rollouts)),
                 *(kl or (0.0, 0.0))]
        total = all_reduce_sum(local, self.info.device)
        n = max(total[1], 1.0)
        out = {"reward": total[0] / n, "reply_tokens": total[2] / n, "tool_call_share": total[3] / n,
               "ended_share": total[4] / n, "rollout_seconds": seconds}
        if kl is not None:
            out["kl"] = total[5] / max(total[6], 1.0)
        return out


def rollout_source(cfg: Any, tokenizer: Any, info: Any, micro_batch: int) -> tuple[Any, Any, list, RolloutSource]:
    """The loop's ``source`` for ``data.kind: prompts`` (see :func:`lmforge.train.train`): the prompts of
    ``data.train_split``, no validation batches (RL is scored by reward, and by ``lmforge rl``'s pass@k before and
    after), and the :class:`RolloutSource`."""
    prompts = load_prompts(cfg.data.dir, cfg.data.train_split)
    fmt = ChatFormat(tokenizer)
    if max(map(len, prompts.ids)) >= cfg.context_length:
        raise ValueError(f"a prompt in {cfg.data.dir} fills the context ({cfg.context_length} tokens); it leaves no "
                         "room for a reply")
    return ConversationDataset(cfg.data.dir, cfg.data.train_split), None, [], RolloutSource(cfg, prompts, fmt, info,
                                                                                          micro_batch)
