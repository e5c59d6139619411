"""Text generation from a trained ``TransformerLM``: KV-cache decoding, sampling, streaming, stop strings.

Layers, bottom up:

* :func:`sample_next` turns a ``(B, V)`` logits row into token ids: greedy (temperature 0), temperature,
  top-k, top-p (nucleus), drawing from an explicit ``torch.Generator`` so a seed reproduces the output.
* :class:`CachedDecoder` is the inference engine. It speaks only token ids: it packs the model's weights
  once (fused QKV and gate|up projections), preallocates a static KV cache for the whole generation,
  prefills the prompts in one forward and then decodes one token per step with a handful of tensor ops
  per layer. Several prompts run as one batch: right padding and a length per row, so each row attends
  to its own tokens only. A row that fills the context slides: it drops its oldest quarter (by default)
  and re-prefills the rest, so generation goes on at an amortized cost.
* :class:`Generator` is the user API: ``generate_ids`` (ids in, ids out) and ``generate`` (text in, text
  out, optionally streamed) with stop tokens and stop strings. ``naive=True`` recomputes the full
  forward of the model itself at every step (no cache); it is the oracle the cached path is tested
  against (greedy tokens must be identical).

The text layer decodes token bytes with an incremental UTF-8 decoder, so a streamed piece never ends in
half a character, and it holds back any tail that could be the start of a stop string, so a stop string
split across tokens is found and never emitted.
"""

from __future__ import annotations

import codecs
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.tokenizer import Tokenizer

logger = logging.getLogger("lmforge")

__all__ = ["Generator", "CachedDecoder", "sample_next", "check_sampling"]


# ==================================================================================================
# Sampling
# ==================================================================================================
def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Validate sampling parameters (``ValueError`` saying which one is wrong and what is allowed)."""
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (got {temperature}); use 0 for greedy decoding")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None (got {top_k!r})")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (got {top_p}); 1 keeps every token, small values keep few")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token of each row of ``logits`` ``(B, V)``; returns ``(B,)`` int64.

    ``temperature == 0`` is greedy (argmax; ties go to the lowest id). Otherwise the logits are divided by
    the temperature, then restricted to the ``top_k`` largest, then to the smallest set of tokens whose
    probabilities add up to at least ``top_p`` (never empty: the most likely token is always kept; ``top_p
    = 1`` keeps every token), and one token is drawn with ``generator``.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1) smallest kept logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above
        drop = mass_before >= top_p  # rank 0 has mass_before 0 < top_p: never dropped
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ==================================================================================================
# The engine: static KV cache over packed weights
# ==================================================================================================
def model_config(model: Any) -> Any:
    """The ``ModelConfig`` of a ``TransformerLM`` (also through DDP/compile wrappers)."""
    for obj in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)):
        for attr in ("cfg", "config"):
            cfg = getattr(obj, attr, None)
            if cfg is not None and hasattr(cfg, "n_layers"):
                return cfg
    raise ValueError(f"{type(model).__name__} has no ModelConfig (.cfg/.config); pass an lmforge TransformerLM")


class CachedDecoder:
    """Prefill + one-token-per-step decoding of a ``TransformerLM`` with a preallocated KV cache.

    The weights are read from the model's state dict (CS336 names) and packed for decoding: ``q|k|v`` and
    ``w1|w3`` concatenated, so each layer does three matrix products per token. The decoder therefore does
    not see later changes to the model's parameters; build a new one (``Generator.refresh()``) after
    training further. The arithmetic is the model's: pre-norm RMSNorm, RoPE on adjacent pairs
    ``(2i, 2i+1)``, causal (grouped-query) attention, SwiGLU, final norm, LM head.

    Two packings exist because the fastest CPU product differs with the number of rows (measured with MKL
    on an AVX2 machine): one row (batch 1) is a matrix-vector product, fastest as ``x @ W`` with ``W``
    stored ``(in, out)``; several rows are fastest as ``W @ x.T`` with ``W`` stored ``(out, in)``, about
    2x faster than ``x @ W`` at 8 rows. A packing is built the first time a batch needs it and then kept.

    Rows are independent: row ``b`` holds its tokens in cache columns ``0 .. lengths[b]-1`` (prompts are
    right-padded, so plain causal attention serves the prefill and RoPE positions are cache columns). When
    a row's cache is full (``context_length`` tokens) and ``step`` must feed it one more token, the row
    slides: of its ``context_length + 1`` tokens (the new one included) it drops the oldest ``window_drop``,
    recomputes the keys and values of the rest with positions restarting at 0, and goes on. So a row
    re-prefills once per ``window_drop`` steps; ``window_drop`` (default: a quarter of the context) trades
    that cost against how much context is lost at once (``1`` is a window sliding by one token per step,
    a re-prefill per step).
    """

    def __init__(self, model: Any, window_drop: int | None = None) -> None:
        cfg = model_config(model)
        self.cfg = cfg
        for wrapper_attr in ("module", "_orig_mod"):  # DDP / torch.compile wrappers prefix the state-dict names
            model = getattr(model, wrapper_attr, model)
        self._sd = {k: v.detach() for k, v in model.state_dict().items()}
        self.n_heads = cfg.n_heads
        self.n_kv = getattr(cfg, "n_kv_heads", None) or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.eps = float(cfg.norm_eps)
        self.context_length = int(cfg.context_length)
        if window_drop is None:
            window_drop = max(1, self.context_length // 4)
        if not 1 <= window_drop <= self.context_length:
            raise ValueError(f"window_drop must be in [1, {self.context_length}] (got {window_drop})")
        self.window_drop = int(window_drop)
        self.embedding = self._sd["token_embeddings.weight"]
        self.device = self.embedding.device
        self.dtype = self.embedding.dtype
        self.ln_final = self._sd["ln_final.weight"]
        self._packs: dict[bool, tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]] = {}
        # RoPE as complex rotations: pair i of a head at position t turns by t * theta^(-2i/D).
        half = self.head_dim // 2
        inv_freq = 1.0 / (float(cfg.rope_theta) ** (torch.arange(half, dtype=torch.float64) * 2 / self.head_dim))
        angles = torch.outer(torch.arange(self.context_length, dtype=torch.float64), inv_freq)  # (S, D/2)
        self.rope = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(self.device)
        # Per-generation state, set by prefill(): caches (L, B, Hkv, S, D), the tokens in the cache (B, S),
        # each row's cached length (a list, and a (B,) tensor for indexing) and the packing in use.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None
        self.lengths: list[int] = []
        self._lengths_t: torch.Tensor | None = None
        self._rows_major = True

    # ---------------------------------------------------------------------------------------------
    def _pack(self, rows_major: bool) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
        """Layer weights and LM head for ``x @ W`` (``rows_major``: ``W`` stored ``(in, out)``) or ``W @ x.T``."""
        if rows_major not in self._packs:
            sd = self._sd

            def fuse(*names: str) -> torch.Tensor:
                w = torch.cat([sd[n] for n in names])  # (sum of outs, in); a fresh copy even for one weight
                return w.t().contiguous() if rows_major else w

            layers = []
            for i in range(self.cfg.n_layers):
                p = f"layers.{i}."
                layers.append((sd[p + "ln1.weight"], fuse(p + "attn.q_proj.weight", p + "attn.k_proj.weight",
                                                          p + "attn.v_proj.weight"),
                               fuse(p + "attn.output_proj.weight"), sd[p + "ln2.weight"],
                               fuse(p + "ffn.w1.weight", p + "ffn.w3.weight"), fuse(p + "ffn.w2.weight")))
            head = fuse("lm_head.weight" if "lm_head.weight" in sd else "token_embeddings.weight")
            self._packs[rows_major] = (layers, head)
        return self._packs[rows_major]

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm in float32, as the model computes it."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), self.eps).to(x.dtype)

    def _forward(self, tokens: torch.Tensor, rows: slice, last: torch.Tensor | None) -> torch.Tensor:
        """Prefill: run ``tokens`` (B, T) in cache rows ``rows``, columns ``0 .. T-1`` (causal attention).

        Returns the logits at column ``last[b]`` of each row (B, V) (``last=None``: column T-1).
        """
        B, T = tokens.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        layers, head = self._pack(self._rows_major)
        rot = self.rope[:T].view(1, T, 1, -1)  # (1, T, 1, D/2)
        x = F.embedding(tokens.reshape(-1), self.embedding)  # (B*T, C)
        for layer, (ln1, w_qkv, w_o, ln2, w_13, w_2) in enumerate(layers):
            qkv = self._matmul(self._rms_norm(x, ln1), w_qkv)  # (B*T, (H + 2 Hkv) D)
            qk = torch.view_as_complex(qkv[:, : (H + Hkv) * D].float().reshape(B, T, H + Hkv, D // 2, 2))
            qk = torch.view_as_real(qk * rot).reshape(B, T, H + Hkv, D).to(x.dtype)  # RoPE on q and k heads
            q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, D)
            k_cache, v_cache = self.k_cache[layer, rows], self.v_cache[layer, rows]  # (B, Hkv, S, D)
            k_cache[:, :, :T] = qk[:, :, H:].transpose(1, 2)
            v_cache[:, :, :T] = qkv[:, (H + Hkv) * D :].view(B, T, Hkv, D).transpose(1, 2)
            att = F.scaled_dot_product_attention(q, k_cache[:, :, :T], v_cache[:, :, :T], is_causal=True,
                                                 enable_gqa=Hkv != H)  # (B, H, T, D)
            x = x + self._matmul(att.transpose(1, 2).reshape(B * T, H * D), w_o, contiguous=False)  # (B*T, C)
            gate, up = self._matmul(self._rms_norm(x, ln2), w_13).chunk(2, dim=-1)  # (B*T, F) each
            x = x + self._matmul(F.silu(gate) * up, w_2, contiguous=False)
        x = x.view(B, T, -1)
        x = x[:, -1] if last is None else x[torch.arange(B, device=self.device), last]  # (B, C)
        return self._matmul(self._rms_norm(x, self.ln_final), head, contiguous=False)  # (B, V)

    def _matmul(self, x: torch.Tensor, w: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
        """``x (N, in)`` times a weight of the packing in use: ``x @ w`` (``w`` is ``(in, out)``) or ``(w @ x.T).T``.

        ``contiguous=False`` may return a transposed view (fine for a residual add or an argmax).
        """
        if self._rows_major:
            return x @ w
        y = (w @ x.contiguous().t()).t()  # (N, out); ``w @ x.T`` is fast only when x's rows are contiguous
        return y.contiguous() if contiguous else y

    # ---------------------------------------------------------------------------------------------
    def prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor:
        """Start a generation: allocate a cache of ``capacity`` columns, run the prompts ``rows``.

        Returns the logits of the next token of each row ``(B, V)``. ``capacity`` must not exceed the
        model's context length; rows slide (see the class docstring) only if it equals it.
        """
        B, T = len(rows), max(len(r) for r in rows)
        assert 0 < T <= capacity <= self.context_length, (T, capacity, self.context_length)
        self._rows_major = B == 1
        self.lengths = [len(r) for r in rows]
        self._lengths_t = torch.tensor(self.lengths, device=self.device)  # (B,)
        self.tokens = torch.zeros(B, capacity, dtype=torch.long, device=self.device)  # right-padded prompts
        for b, r in enumerate(rows):
            self.tokens[b, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        shape = (self.cfg.n_layers, B, self.n_kv, capacity, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # Right padding: a row's real tokens never see its pads under causal attention (pads come after).
        last = None if min(self.lengths) == T else self._lengths_t - 1
        return self._forward(self.tokens[:, :T], slice(None), last)

    def _slide(self, full: list[int]) -> None:
        """Rows ``full`` (at capacity) keep their newest ``keep - 1`` tokens, re-prefilled (the next token makes ``keep``)."""
        assert self.k_cache is not None and self.k_cache.shape[3] == self.context_length, "cache full"
        keep = self.context_length + 1 - self.window_drop  # >= 1
        groups = [slice(None)] if len(full) == len(self.lengths) else [slice(b, b + 1) for b in full]
        for rows in groups:
            kept = self.tokens[rows, self.context_length - keep + 1 :].clone()  # (b, keep - 1)
            self.tokens[rows, : keep - 1] = kept
            if keep > 1:
                self._forward(kept, rows, None)
        for b in full:
            self.lengths[b] = keep - 1
        self._lengths_t = torch.tensor(self.lengths, device=self.device)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ``(B,)`` after each row's cached tokens; returns next-token logits ``(B, V)``.

        A row whose cache is full slides first (class docstring).
        """
        assert self.k_cache is not None, "prefill not called"
        S = self.k_cache.shape[3]
        full = [b for b, n in enumerate(self.lengths) if n == S]
        if full:
            self._slide(full)
        B = tokens.shape[0]
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        G = H // Hkv
        lengths = self.lengths
        uniform = min(lengths) == max(lengths)
        end = max(lengths) + 1  # attend to the valid prefix only
        pos = self._lengths_t  # (B,) the column (= RoPE position) of the new token
        if uniform:
            col = lengths[0]
            rot = self.rope[col : col + 1].view(1, 1, -1)  # (1, 1, D/2)
            self.tokens[:, col] = tokens
            mask = None
        else:
            rot = self.rope[pos].view(B, 1, -1)  # (B, 1, D/2)
            self.tokens[torch.arange(B, device=self.device), pos] = tokens
            # the cache viewed as (L, B*Hkv*S, D): row b, head h, column c is entry (b*Hkv + h)*S + c
            slot = ((torch.arange(B * Hkv, device=self.device) * S).view(B, Hkv) + pos[:, None]).view(-1)
            mask = (torch.arange(end, device=self.device)[None, :] <= pos[:, None]).view(B, 1, 1, end)
        layers, head = self._pack(self._rows_major)
        scale = 1.0 / math.sqrt(D)
        x = F.embedding(tokens, self.embedding)  # (B, C)
        for layer, (ln1, w_qkv, w_o, ln2, w_13, w_2) in enumerate(layers):
            qkv = self._matmul(self._rms_norm(x, ln1), w_qkv)  # (B, (H + 2 Hkv) D)
            qk = torch.view_as_complex(qkv[:, : (H + Hkv) * D].float().view(B, H + Hkv, D // 2, 2))
            qk = torch.view_as_real(qk * rot).view(B, H + Hkv, D).to(x.dtype)  # RoPE on q and k heads
            k_new, v_new = qk[:, H:], qkv[:, (H + Hkv) * D :].view(B, Hkv, D)  # (B, Hkv, D)
            k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]  # (B, Hkv, S, D)
            if uniform:
                k_cache[:, :, col] = k_new
                v_cache[:, :, col] = v_new
            else:
                k_cache.view(-1, D).index_copy_(0, slot, k_new.reshape(-1, D))
                v_cache.view(-1, D).index_copy_(0, slot, v_new.reshape(-1, D))
            # one query per row: (B, Hkv, G, D) @ (B, Hkv, D, end) -> scores (B, Hkv, G, end)
            q = qk[:, :H].view(B, Hkv, G, D)
            scores = torch.matmul(q, k_cache[:, :, :end].transpose(-1, -2)).mul_(scale)
            if mask is not None:
                scores.masked_fill_(~mask, float("-inf"))
            att = torch.matmul(torch.softmax(scores, dim=-1), v_cache[:, :, :end])  # (B, Hkv, G, D)
            x = x + self._matmul(att.view(B, H * D), w_o, contiguous=False)  # (B, C)
            gate, up = self._matmul(self._rms_norm(x, ln2), w_13).chunk(2, dim=-1)  # (B, F) each
            x = x + self._matmul(F.silu(gate) * up, w_2, contiguous=False)
        self.lengths = [n + 1 for n in lengths]
        self._lengths_t = pos + 1
        return self._matmul(self._rms_norm(x, self.ln_final), head, contiguous=False)  # (B, V)


# ==================================================================================================
# Text layer: incremental UTF-8 decoding and stop strings
# ==================================================================================================
class _TextStream:
    """Turns one row's generated token bytes into text pieces, cutting at the first stop string.

    Bytes go through an incremental UTF-8 decoder (an incomplete character waits for its next bytes).
    The longest tail of the text that is a proper prefix of some stop string is held back until the
    next token shows whether the stop string completes, so it is found even when split across tokens.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held = ""
        self.done = False

    def _emit(self, text: str) -> str:
        text = self.held + text
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.done, self.held = True, ""
            return text[: min(hits)]
        keep = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:n]):
                    keep = n
                    break
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def feed(self, data: bytes) -> str:
        """Text that is final after appending ``data`` (possibly empty)."""
        return self._emit(self.decoder.decode(data))

    def finish(self) -> str:
        """Flush at the end of generation (a dangling partial character becomes U+FFFD)."""
        if self.done:
            return ""
        self.done = True
        text, self.held = self.held + self.decoder.decode(b"", final=True), ""
        return text


# ==================================================================================================
# Generator: the user API
# ==================================================================================================
class Generator:
    """Generate text with a trained ``TransformerLM`` and its ``Tokenizer``.

    >>> gen = Generator.from_run("runs/speedrun")                      # doctest: +SKIP
    >>> gen.generate("ROMEO:", max_new_tokens=50, temperature=0.8, seed=0)  # doctest: +SKIP
    """

    def __init__(self, model: Any, tokenizer: "Tokenizer | None" = None, device: Any = None,
                 window_drop: int | None = None) -> None:
        """``window_drop``: tokens a row drops when its context is full (default: a quarter of the context)."""
        from lmforge.common import resolve_device

        if device is not None:
            model = model.to(resolve_device(device) if isinstance(device, str) else device)
        self.model = model.eval()
        self.cfg = model_config(model)
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.vocab_limit = self.cfg.vocab_size
        self._token_bytes: list[bytes] | None = None
        if tokenizer is not None:
            if tokenizer.vocab_size > self.cfg.vocab_size:
                raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {self.cfg.vocab_size}; "
                                 "load the tokenizer the model was trained with (the run's tokenizer.json)")
            self.vocab_limit = tokenizer.vocab_size  # never sample the model's padding ids
        self.decoder = CachedDecoder(model, window_drop)

    @classmethod
    def from_run(cls, run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                 device: str = "auto") -> "Generator":
        """Load model + tokenizer from a run directory (``config.yaml``, ``tokenizer.json``, checkpoints).

        Uses ``checkpoint`` if given (a file, or ``"best"`` for ``checkpoints/best.safetensors``), else the
        newest step checkpoint that verifies (a corrupt newest one is skipped with a warning).
        """
        from lmforge.checkpoint import CheckpointManager, apply_checkpoint, read_checkpoint
        from lmforge.common import resolve_device
        from lmforge.config import from_dict, load_yaml
        from lmforge.model import ModelConfig, TransformerLM
        from lmforge.tokenizer import Tokenizer

        run = Path(run_dir)
        if not run.is_dir():
            raise ValueError(f"run directory {run} does not exist; train one first (lmforge train CONFIG.yaml "
                             f"--run-dir {run}, or lmforge speedrun --out {run})")
        for name in ("config.yaml", "tokenizer.json"):
            if not (run / name).is_file():
                raise ValueError(f"{run} has no {name}; is it a run directory written by lmforge train?")
        model_cfg = from_dict(ModelConfig, load_yaml(run / "config.yaml").get("model"), path="model")
        dev = resolve_device(device)
        if checkpoint is not None:
            ckpt_path = CheckpointManager(run).best_path if str(checkpoint) == "best" else Path(checkpoint)
            ckpt = read_checkpoint(ckpt_path)
        else:
            found = CheckpointManager(run).load_latest()
            if found is None:
                raise ValueError(f"no checkpoint in {run / 'checkpoints'}; train first, or pass --checkpoint FILE")
            ckpt_path, ckpt = found
        model = TransformerLM(model_cfg)
        step = apply_checkpoint(ckpt, model)
        logger.info("loaded %s (step %d) on %s", ckpt_path, step, dev)
        return cls(model.to(dev), Tokenizer.load(run / "tokenizer.json"))

    def refresh(self) -> None:
        """Re-read the model's weights (call after changing them; the decoder packs a copy)."""
        self.decoder = CachedDecoder(self.model, self.decoder.window_drop)

    # ---------------------------------------------------------------------------------------------
    # ids in, ids out
    # ---------------------------------------------------------------------------------------------
    def _check_prompts(self, rows: list[list[int]], max_new_tokens: int, overflow: str) -> int:
        """Validate token rows; returns how many new tokens to generate (with ``overflow="stop"``: how many
        fit in the context, with a warning if fewer than asked)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer (got {max_new_tokens!r})")
        if overflow not in ("slide", "stop"):
            raise ValueError(f"overflow must be 'slide' or 'stop' (got {overflow!r}): 'slide' drops the oldest tokens "
                             "when the context is full and goes on, 'stop' ends generation there")
        if not rows:
            raise ValueError("no prompts given; pass at least one prompt")
        ctx = self.cfg.context_length
        for i, r in enumerate(rows):
            if len(r) == 0:
                raise ValueError(f"prompt {i} is empty; give at least one token (e.g. <|endoftext|> to start a document)")
            if len(r) > ctx:
                raise ValueError(f"prompt {i} has {len(r)} tokens but the model's context length is {ctx}; "
                                 "shorten the prompt")
            bad = [t for t in r if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} holds token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        longest = max(len(r) for r in rows)
        fit = ctx - longest + 1  # the last new token is sampled, never fed back
        if overflow == "stop" and max_new_tokens > fit:
            logger.warning("prompt (%d tokens) + max_new_tokens (%d) exceeds the context length %d: generation "
                           "stops after %d new tokens", longest, max_new_tokens, ctx, fit)
            return fit
        return max_new_tokens

    def _token_steps(self, rows: list[list[int]], n_new: int, temperature: float, top_k: int | None,
                     top_p: float | None, seed: int | None, naive: bool) -> Iterator[list[int]]:
        """Yield the next token of every row, ``n_new`` times (rows that have stopped keep going; callers ignore them).

        A row that outgrows the context slides (:class:`CachedDecoder`); the naive path applies the same
        policy to its window: after appending a token, a window longer than the context drops its
        oldest ``window_drop`` tokens.
        """
        gen = torch.Generator(device=self.device)
        if seed is None:
            gen.seed()  # fresh entropy
        else:
            gen.manual_seed(int(seed))

        def pick(logits: torch.Tensor) -> torch.Tensor:
            if self.vocab_limit < logits.shape[-1]:
                logits = logits[:, : self.vocab_limit]
            return sample_next(logits, temperature, top_k, top_p, gen)

        ctx = self.cfg.context_length
        if naive:
            keep = ctx + 1 - self.decoder.window_drop
            seqs = [list(r) for r in rows]
            for _ in range(n_new):
                with torch.inference_mode():
                    logits = torch.cat([self.model(torch.tensor([s], device=self.device))[:, -1] for s in seqs])
                    nxt = pick(logits).tolist()
                for b, t in enumerate(nxt):
                    seqs[b].append(t)
                    if len(seqs[b]) > ctx:
                        seqs[b] = seqs[b][-keep:]
                yield nxt
            return
        longest = max(len(r) for r in rows)
        capacity = min(ctx, longest + n_new - 1)  # a full cache (capacity == ctx) slides, see CachedDecoder
        with torch.inference_mode():
            nxt = pick(self.decoder.prefill(rows, max(capacity, longest)))
        for i in range(n_new):
            out = nxt.tolist()
            if i + 1 < n_new:
                with torch.inference_mode():
                    nxt = pick(self.decoder.step(nxt))
            yield out

    def generate_ids(self, prompt_ids: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int = 128,
                     temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                     seed: int | None = None, stop_ids: Sequence[int] | None = None, naive: bool = False,
                     stream: bool = False, overflow: str = "slide") -> Any:
        """Generate token ids after one prompt (a list of ids) or several (a list of lists).

        Returns the new ids (a list, or a list of lists), without the prompt and without the stop token
        that ended a row. ``stop_ids`` defaults to the tokenizer's ``<|endoftext|>``. ``stream=True``
        returns an iterator instead: of ids for one prompt, of ``(row, id)`` pairs for several.
        ``naive=True`` recomputes the model's full forward at every step (slow; the test oracle).

        Past the context length (``overflow="slide"``, the default) a row keeps generating: when its
        context is full it drops its oldest ``window_drop`` tokens (a quarter of the context unless the
        Generator was built with another value), recomputes the cache of the rest, and goes on, so the
        model always sees the most recent tokens at positions from 0. ``overflow="stop"`` ends generation
        when the context is full instead (with a warning). A prompt longer than the context is an error.
        """
        if hasattr(prompt_ids, "tolist"):  # a tensor or an array
            prompt_ids = prompt_ids.tolist()
        single = len(prompt_ids) > 0 and not isinstance(prompt_ids[0], (list, tuple))
        rows = [list(prompt_ids)] if single else [list(r) for r in prompt_ids]
        check_sampling(temperature, top_k, top_p)
        n_new = self._check_prompts(rows, max_new_tokens, overflow)
        if stop_ids is None:
            eot = getattr(self.tokenizer, "eot_id", None)
            stop_ids = [] if eot is None else [eot]
        steps = self._token_steps(rows, n_new, temperature, top_k, top_p, seed, naive)
        it = self._ids_stream(steps, len(rows), set(stop_ids))
        if stream:
            return (t for _, t in it) if single else it
        out: list[list[int]] = [[] for _ in rows]
        for b, t in it:
            out[b].append(t)
        return out[0] if single else out

    @staticmethod
    def _ids_stream(steps: Iterator[list[int]], n_rows: int, stop_ids: set[int]) -> Iterator[tuple[int, int]]:
        done = [False] * n_rows
        for toks in steps:
            for b, t in enumerate(toks):
                if done[b]:
                    continue
                if t in stop_ids:
                    done[b] = True
                else:
                    yield b, t
            if all(done):
                return

    # ---------------------------------------------------------------------------------------------
    # text in, text out
    # ---------------------------------------------------------------------------------------------
    def _bytes_of(self, token_id: int) -> bytes:
        if self._token_bytes is None:
            tok = self.tokenizer
            table = [b""] * tok.vocab_size
            for i, b in tok.vocab.items():
                table[i] = b
            for s, i in tok.special_tokens.items():
                table[i] = s.encode("utf-8")
            self._token_bytes = table
        return self._token_bytes[token_id]

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 128, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: Sequence[str] | str | None = None, stream: bool = False, naive: bool = False,
                 overflow: str = "slide") -> Any:
        """Continue one prompt (``str``) or several (``list[str]``, batched) and return the new text.

        Generation of a row ends at ``<|endoftext|>``, at the first of the ``stop`` strings (which is not
        returned, even when it spans several tokens), or after ``max_new_tokens`` tokens. Past the context
        length the oldest tokens are dropped a block at a time (``overflow``: see :meth:`generate_ids`). ``stream=True`` returns an iterator of text pieces
        (for several prompts: ``(row, piece)`` pairs); a piece never ends inside a UTF-8 character.
        """
        if self.tokenizer is None:
            raise ValueError("this Generator has no tokenizer; use generate_ids, or pass tokenizer=")
        single = isinstance(prompts, str)
        texts = [prompts] if single else list(prompts)
        for i, t in enumerate(texts):
            if not isinstance(t, str) or t == "":
                raise ValueError(f"prompt {i} is empty (or not a string); give some text to continue")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        check_sampling(temperature, top_k, top_p)
        rows = [self.tokenizer.encode(t) for t in texts]
        n_new = self._check_prompts(rows, max_new_tokens, overflow)
        eot = getattr(self.tokenizer, "eot_id", None)
        steps = self._token_steps(rows, n_new, temperature, top_k, top_p, seed, naive)
        it = self._text_stream(steps, len(rows), set() if eot is None else {eot}, stops)
        if stream:
            return (p for _, p in it) if single else it
        out = [""] * len(rows)
        for b, piece in it:
            out[b] += piece
        return out[0] if single else out

    def _text_stream(self, steps: Iterator[list[int]], n_rows: int, stop_ids: set[int],
                     stops: list[str]) -> Iterator[tuple[int, str]]:
        rows = [_TextStream(stops) for _ in range(n_rows)]
        for b, t in self._ids_stream(steps, n_rows, stop_ids):
            row = rows[b]
            if row.done:
                continue
            piece = row.feed(self._bytes_of(t))
            if piece:
                yield b, piece
            if all(r.done for r in rows):
                break
        for b, row in enumerate(rows):
            piece = row.finish()
            if piece:
                yield b, piece
