"""Text generation from a trained ``TransformerLM``: KV-cache decoding, sampling, streaming, stop strings.

Layers, bottom up:

* :func:`sample_next` turns a ``(B, V)`` logits row into token ids: greedy (temperature 0), temperature,
  top-k, top-p (nucleus), drawing from an explicit ``torch.Generator`` so a seed reproduces the output.
* :class:`CachedDecoder` is the inference engine. It speaks only token ids: it packs the model's weights
  once (fused QKV and gate|up projections), preallocates a static KV cache for the whole generation,
  prefills the prompts in one forward and then decodes one token per step with a handful of tensor ops
  per layer. Several prompts run as one batch: left padding plus an attention mask that hides the pads,
  with each row's RoPE positions starting at 0 at its first real token.
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


def _in_out(*weights: torch.Tensor) -> torch.Tensor:
    """Stack ``(out, in)`` weights along ``out`` and store them as one contiguous ``(in, sum of outs)`` matrix.

    ``x @ W`` with this layout is up to 2x faster than ``F.linear(x, W.T)`` for the few-row products of
    decoding on CPU (measured with MKL: the transposed operand takes a slower GEMM path at batch > 1).
    """
    return torch.cat(weights).t().contiguous()  # (in, out)


class CachedDecoder:
    """Prefill + one-token-per-step decoding of a ``TransformerLM`` with a preallocated KV cache.

    The weights are read from the model's state dict (CS336 names) once, at construction, and packed
    for decoding: ``q|k|v`` and ``w1|w3`` concatenated so each layer does three matrix products per
    token. The decoder therefore does not see later changes to the model's parameters; build a new one
    (``Generator.refresh()``) after training further. The arithmetic is the model's: pre-norm RMSNorm,
    RoPE on adjacent pairs ``(2i, 2i+1)``, causal (grouped-query) attention, SwiGLU, final norm, LM head.
    """

    def __init__(self, model: Any) -> None:
        cfg = model_config(model)
        self.cfg = cfg
        for wrapper_attr in ("module", "_orig_mod"):  # DDP / torch.compile wrappers prefix the state-dict names
            model = getattr(model, wrapper_attr, model)
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        self.n_heads = cfg.n_heads
        self.n_kv = getattr(cfg, "n_kv_heads", None) or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.eps = float(cfg.norm_eps)
        self.context_length = int(cfg.context_length)
        self.embedding = sd["token_embeddings.weight"]
        self.device = self.embedding.device
        self.dtype = self.embedding.dtype
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            self.layers.append((
                sd[p + "ln1.weight"],
                _in_out(sd[p + "attn.q_proj.weight"], sd[p + "attn.k_proj.weight"], sd[p + "attn.v_proj.weight"]),
                _in_out(sd[p + "attn.output_proj.weight"]),
                sd[p + "ln2.weight"],
                _in_out(sd[p + "ffn.w1.weight"], sd[p + "ffn.w3.weight"]),
                _in_out(sd[p + "ffn.w2.weight"]),
            ))
        self.ln_final = sd["ln_final.weight"]
        # The LM head stays (V, C): ``W @ h.T`` beats ``h @ W.T`` for the large V at decode-sized batches on CPU.
        self.lm_head = sd.get("lm_head.weight", self.embedding).contiguous()
        # RoPE as complex rotations: pair i of a head at position t turns by t * theta^(-2i/D).
        half = self.head_dim // 2
        inv_freq = 1.0 / (float(cfg.rope_theta) ** (torch.arange(half, dtype=torch.float64) * 2 / self.head_dim))
        angles = torch.outer(torch.arange(self.context_length, dtype=torch.float64), inv_freq)  # (S, D/2)
        self.rope = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(self.device)
        # Per-generation state, set by prefill(): caches (L, B, Hkv, S, D), cached length, left padding per
        # row (B,) and, when rows are padded, which cache columns each row may attend to (B, S).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.length = 0
        self.pad: torch.Tensor | None = None
        self.key_valid: torch.Tensor | None = None

    # ---------------------------------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm in float32, as the model computes it."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), self.eps).to(x.dtype)

    def _rotate(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """RoPE: ``x`` (B, T, H, D) times ``rot`` (B, T, 1, D/2) complex, pairs (2i, 2i+1) as complex numbers."""
        B, T, H, D = x.shape
        xc = torch.view_as_complex(x.float().reshape(B, T, H, D // 2, 2))  # (B, T, H, D/2)
        return torch.view_as_real(xc * rot).reshape(B, T, H, D).to(x.dtype)  # (B, T, H, D)

    def _forward(self, tokens: torch.Tensor, start: int, rot: torch.Tensor,
                 mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """Run ``tokens`` (B, T) occupying cache columns ``start .. start+T-1``; returns last-column logits (B, V)."""
        B, T = tokens.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        end = start + T
        # Hidden states stay 2-D (B*T, C): a 2-D @ 2-D product is one GEMM call, while a 3-D input goes through
        # matmul's batched-folding path, measurably slower for the few rows of a decode step.
        x = F.embedding(tokens.reshape(-1), self.embedding)  # (B*T, C)
        for layer, (ln1, w_qkv, w_o, ln2, w_13, w_2) in enumerate(self.layers):
            qkv = self._rms_norm(x, ln1) @ w_qkv  # (B*T, (H + 2 Hkv) D)
            qk = self._rotate(qkv[:, : (H + Hkv) * D].view(B, T, H + Hkv, D), rot)  # q and k heads in one go
            q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, D)
            self.k_cache[layer, :, :, start:end] = qk[:, :, H:].transpose(1, 2)  # (B, Hkv, T, D)
            self.v_cache[layer, :, :, start:end] = qkv[:, (H + Hkv) * D :].view(B, T, Hkv, D).transpose(1, 2)
            att = F.scaled_dot_product_attention(
                q, self.k_cache[layer, :, :, :end], self.v_cache[layer, :, :, :end],
                attn_mask=mask, is_causal=causal, enable_gqa=Hkv != H)  # (B, H, T, D)
            x = x + att.transpose(1, 2).reshape(B * T, H * D) @ w_o  # (B*T, C)
            gate, up = (self._rms_norm(x, ln2) @ w_13).chunk(2, dim=-1)  # (B*T, F) each
            x = x + (F.silu(gate) * up) @ w_2
        h = self._rms_norm(x.view(B, T, -1)[:, -1], self.ln_final)  # (B, C)
        return (self.lm_head @ h.t()).t()  # (B, V)

    # ---------------------------------------------------------------------------------------------
    def prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor:
        """Start a generation: left-pad ``rows``, allocate a cache of ``capacity`` columns, run the prompts.

        Returns the logits of the next token of each row ``(B, V)``. ``capacity`` (prompt + new tokens)
        must not exceed the model's context length.
        """
        B, T = len(rows), max(len(r) for r in rows)
        assert 0 < T <= capacity <= self.context_length, (T, capacity, self.context_length)
        self.pad = torch.tensor([T - len(r) for r in rows], device=self.device)  # (B,)
        tokens = torch.zeros(B, T, dtype=torch.long)
        for b, r in enumerate(rows):
            tokens[b, T - len(r):] = torch.as_tensor(list(r), dtype=torch.long)
        tokens = tokens.to(self.device)
        shape = (len(self.layers), B, self.n_kv, capacity, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.length = T
        cols = torch.arange(T, device=self.device)
        if int(self.pad.max()) == 0:  # no padding: plain causal attention, and no masks while decoding
            self.key_valid = None
            return self._forward(tokens, 0, self.rope[:T].view(1, T, 1, -1), None, causal=True)
        # Row b's real tokens sit in columns pad[b]..T-1 and get positions 0, 1, ...; pads are never
        # attended to by real tokens. A pad query attends to itself only (keeps its row of the softmax finite).
        self.key_valid = torch.zeros(B, capacity, dtype=torch.bool, device=self.device)  # (B, S)
        self.key_valid[:, :T] = cols[None, :] >= self.pad[:, None]
        causal = cols[:, None] >= cols[None, :]  # (T, T)
        mask = (causal[None] & self.key_valid[:, None, :T]) | torch.eye(T, dtype=torch.bool, device=self.device)
        positions = (cols[None, :] - self.pad[:, None]).clamp(min=0)  # (B, T)
        rot = self.rope[positions].unsqueeze(2)  # (B, T, 1, D/2)
        return self._forward(tokens, 0, rot, mask.unsqueeze(1), causal=False)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row ``(B,)`` at the next cache column; returns next-token logits ``(B, V)``."""
        col = self.length
        assert self.k_cache is not None and col < self.k_cache.shape[3], "cache full or prefill not called"
        self.length = col + 1
        if self.key_valid is None:
            rot = self.rope[col : col + 1].view(1, 1, 1, -1)
            mask = None
        else:
            rot = self.rope[col - self.pad].view(-1, 1, 1, self.rope.shape[-1])  # (B, 1, 1, D/2)
            self.key_valid[:, col] = True
            mask = self.key_valid[:, None, None, : col + 1]  # (B, 1, 1, S)
        return self._forward(tokens.view(-1, 1), col, rot, mask, causal=False)


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

    def __init__(self, model: Any, tokenizer: "Tokenizer | None" = None, device: Any = None) -> None:
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
        self.decoder = CachedDecoder(model)

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
        self.decoder = CachedDecoder(self.model)

    # ---------------------------------------------------------------------------------------------
    # ids in, ids out
    # ---------------------------------------------------------------------------------------------
    def _check_prompts(self, rows: list[list[int]], max_new_tokens: int) -> int:
        """Validate token rows; returns how many new tokens fit in the context (warns if fewer than asked)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer (got {max_new_tokens!r})")
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
        if max_new_tokens > fit:
            logger.warning("prompt (%d tokens) + max_new_tokens (%d) exceeds the context length %d: generation "
                           "stops after %d new tokens", longest, max_new_tokens, ctx, fit)
            return fit
        return max_new_tokens

    def _token_steps(self, rows: list[list[int]], n_new: int, temperature: float, top_k: int | None,
                     top_p: float | None, seed: int | None, naive: bool) -> Iterator[list[int]]:
        """Yield the next token of every row, ``n_new`` times (rows that have stopped keep going; callers ignore them)."""
        gen = torch.Generator(device=self.device)
        if seed is None:
            gen.seed()  # fresh entropy
        else:
            gen.manual_seed(int(seed))

        def pick(logits: torch.Tensor) -> torch.Tensor:
            if self.vocab_limit < logits.shape[-1]:
                logits = logits[:, : self.vocab_limit]
            return sample_next(logits, temperature, top_k, top_p, gen)

        if naive:
            seqs = [list(r) for r in rows]
            for _ in range(n_new):
                with torch.inference_mode():
                    logits = torch.cat([self.model(torch.tensor([s], device=self.device))[:, -1] for s in seqs])
                    nxt = pick(logits).tolist()
                for s, t in zip(seqs, nxt):
                    s.append(t)
                yield nxt
            return
        capacity = max(len(r) for r in rows) + n_new - 1
        with torch.inference_mode():
            nxt = pick(self.decoder.prefill(rows, max(capacity, max(len(r) for r in rows))))
        for i in range(n_new):
            out = nxt.tolist()
            if i + 1 < n_new:
                with torch.inference_mode():
                    nxt = pick(self.decoder.step(nxt))
            yield out

    def generate_ids(self, prompt_ids: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int = 128,
                     temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                     seed: int | None = None, stop_ids: Sequence[int] | None = None, naive: bool = False,
                     stream: bool = False) -> Any:
        """Generate token ids after one prompt (a list of ids) or several (a list of lists).

        Returns the new ids (a list, or a list of lists), without the prompt and without the stop token
        that ended a row. ``stop_ids`` defaults to the tokenizer's ``<|endoftext|>``. ``stream=True``
        returns an iterator instead: of ids for one prompt, of ``(row, id)`` pairs for several.
        ``naive=True`` recomputes the model's full forward at every step (slow; the test oracle).
        """
        if hasattr(prompt_ids, "tolist"):  # a tensor or an array
            prompt_ids = prompt_ids.tolist()
        single = len(prompt_ids) > 0 and not isinstance(prompt_ids[0], (list, tuple))
        rows = [list(prompt_ids)] if single else [list(r) for r in prompt_ids]
        check_sampling(temperature, top_k, top_p)
        n_new = self._check_prompts(rows, max_new_tokens)
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
                 stop: Sequence[str] | str | None = None, stream: bool = False, naive: bool = False) -> Any:
        """Continue one prompt (``str``) or several (``list[str]``, batched) and return the new text.

        Generation of a row ends at ``<|endoftext|>``, at the first of the ``stop`` strings (which is not
        returned, even when it spans several tokens), or after ``max_new_tokens`` tokens (fewer if the
        context length runs out; a warning says so). ``stream=True`` returns an iterator of text pieces
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
        n_new = self._check_prompts(rows, max_new_tokens)
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
