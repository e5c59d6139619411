"""LoRA: low-rank adapters swapped in for :class:`~lmforge.model.layers.Linear` modules from outside.

``apply_lora(model, cfg)`` replaces every matching ``Linear`` by a :class:`LoraLinear` that holds the *same*
frozen weight Parameter (not a copy) plus two small trainable factors::

    y = x Wᵀ + (alpha / rank) · dropout(x) Aᵀ Bᵀ        A (rank, in)  B (out, rank)

exactly as PEFT's ``lora.Linear`` (A Kaiming-uniform with ``a = √5``, B zero, so a fresh adapter changes
nothing). State-dict names: the base weight keeps its key (``layers.0.attn.q_proj.weight``); the factors are
``layers.0.attn.q_proj.lora_A`` / ``.lora_B``. Every non-adapter parameter of the model is frozen.

Every path sees the adapters: the reference path calls the module; the fast path (``ModelConfig.fast``)
projects through the base weights and adds :meth:`LoraLinear.adapter` of each wrapped projection
(``fused._project_modules``), and the fused LM-head loss is skipped when ``lm_head`` is wrapped. The
decode engine packs plain weights from the state dict, so decode a merged model: :func:`merge_lora` in place
or :func:`merged_copy`; :func:`has_lora` tells whether a model still carries adapters.

Adapters save alone (:func:`save_adapters`: ``adapter_model.safetensors`` + ``adapter_config.json``, with a
fingerprint of the base weights) and load only onto the base they were trained on (:func:`load_adapters`).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import Tensor, nn

from lmforge.checkpoint import _digest, lora_delta, unwrap_model  # _digest: the checkpoint's hash over named tensors
from lmforge.common import atomic_open, check_input_file
from lmforge.model.layers import Linear

__all__ = ["LoraConfig", "LoraLinear", "DEFAULT_TARGETS", "ADAPTER_WEIGHTS", "ADAPTER_CONFIG", "target_matches",
           "apply_lora", "has_lora", "lora_modules", "lora_parameters", "lora_state_dict", "load_lora_state_dict",
           "check_adapters_fit", "merge_lora", "merged_copy", "base_fingerprint", "save_adapters",
           "write_adapter_files", "read_adapter_config", "load_adapters"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3")
"""Every attention and feed-forward projection of a block (not the embeddings, not the LM head)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""File name of saved adapter factors (PEFT's name)."""
ADAPTER_CONFIG = "adapter_config.json"
"""File name of a saved adapter's :class:`LoraConfig`, wrapped module names and base fingerprint."""
_FORMAT = "lmforge-lora"
_VERSION = 1


@dataclass
class LoraConfig:
    """Shape of the adapters; validated on construction."""

    rank: int = 8
    """Inner dimension ``r`` of each adapter (``A: (r, in)``, ``B: (out, r)``); at least 1."""
    alpha: float = 16.0
    """Scale numerator: the update is ``(alpha / rank) · B A``; positive."""
    dropout: float = 0.0
    """Dropout probability on the adapter input (training mode only); in ``[0, 1)``."""
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Module-name patterns (see :func:`target_matches`): a bare name or suffix such as ``q_proj`` or
    ``attn.q_proj`` matches every module whose dotted name ends with it (PEFT's ``target_modules`` list rule);
    shell wildcards match full names, e.g. ``layers.*.attn.*_proj`` or ``layers.0.ffn.w?``. Only lmforge
    ``Linear`` modules are wrapped, and each pattern must match at least one of them."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora.rank must be an integer >= 1, got {self.rank!r}; 8 or 16 is typical")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0 \
                or not math.isfinite(self.alpha):
            raise ValueError(f"lora.alpha must be a positive number, got {self.alpha!r}; 2 x rank is typical")
        self.alpha = float(self.alpha)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be a probability in [0, 1), got {self.dropout!r}")
        self.dropout = float(self.dropout)
        if isinstance(self.targets, str):
            raise ValueError(f"lora.targets must be a list of module-name patterns, got the string "
                             f"{self.targets!r}; write [{self.targets!r}]")
        self.targets = list(self.targets)
        if not self.targets or not all(isinstance(t, str) and t.strip() for t in self.targets):
            raise ValueError(f"lora.targets must be a non-empty list of module-name patterns such as "
                             f"{list(DEFAULT_TARGETS)}, got {self.targets!r}")

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on ``B A``."""
        return self.alpha / self.rank


def target_matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` (dotted, as in ``named_modules``) matches ``pattern``.

    ``fnmatch`` on the full name, or on its tail after a dot: ``q_proj`` and ``attn.q_proj`` match
    ``layers.3.attn.q_proj``; ``layers.*.ffn.w1`` matches the w1 of every layer; ``proj`` matches nothing
    (a suffix must be whole dotted components).

    >>> target_matches("layers.3.attn.q_proj", "q_proj"), target_matches("layers.3.attn.q_proj", "proj")
    (True, False)
    """
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


class LoraLinear(nn.Module):
    """A :class:`Linear` plus a low-rank update: ``x Wᵀ + scale · dropout(x) Aᵀ Bᵀ``.

    ``weight`` is the wrapped layer's Parameter itself (frozen); ``lora_A (rank, in)`` is Kaiming-uniform
    (``a=√5``, bound ``1/√in``, as PEFT), ``lora_B (out, rank)`` zero.
    """

    def __init__(self, base: Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.dropout = rank, float(alpha), float(dropout)
        self.scale = self.alpha / rank
        w = base.weight
        self.weight = w  # the same Parameter object: never copied
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, device=w.device, dtype=w.dtype))
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """Re-draw the adapter: ``A`` Kaiming-uniform (``a=√5``), ``B`` zero (the update starts at 0)."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            self.lora_B.zero_()

    def adapter(self, x: Tensor) -> Tensor:
        """The update alone: ``scale · dropout(x) Aᵀ Bᵀ``, ``(..., in) -> (..., out)``."""
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout, training=True)
        return (x @ self.lora_A.T @ self.lora_B.T) * self.scale  # (..., in) -> (..., r) -> (..., out)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.T + self.adapter(x)  # (..., out)

    def delta_weight(self) -> Tensor:
        """``scale · B A`` ``(out, in)`` in the weight's dtype (computed in at least float32)."""
        return lora_delta(self.lora_A, self.lora_B, self.scale, self.weight.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"alpha={self.alpha}, dropout={self.dropout}")


# --------------------------------------------------------------------------------------------------
# Wrapping, state, merging
# --------------------------------------------------------------------------------------------------
def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """The :class:`LoraLinear` modules of ``model`` by dotted name (DDP/compile wrappers are looked through)."""
    return {n: m for n, m in unwrap_model(model).named_modules() if isinstance(m, LoraLinear)}


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries unmerged LoRA adapters."""
    return bool(lora_modules(model))


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def _targets(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Names of the ``Linear`` modules ``cfg.targets`` select, in model order; ``ValueError`` if a pattern
    selects nothing or a selected weight is shared (tied embeddings: merging would change the embeddings)."""
    linears = [n for n, m in model.named_modules() if type(m) is Linear]
    unmatched = [p for p in cfg.targets if not any(target_matches(n, p) for n in linears)]
    if list(cfg.targets) == list(DEFAULT_TARGETS):  # the default means every projection the model has (no w3 in
        unmatched = []                                # a ReLU² feed-forward, model.mlp: relu2)
    if unmatched:
        raise ValueError(f"LoRA target pattern(s) {unmatched} match no Linear module; available: {linears}")
    names = [n for n in linears if any(target_matches(n, p) for p in cfg.targets)]
    owners: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(n)
    for n in names:
        shared = [o for o in owners[id(model.get_submodule(n).weight)] if o != n + ".weight"]
        if shared:
            raise ValueError(f"LoRA target {n!r} shares its weight with {shared} (tied embeddings); merging "
                             "would change both, so leave it out of lora.targets")
    return names


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Wrap every ``Linear`` of ``model`` matching ``cfg.targets`` in a :class:`LoraLinear`, in place.

    The base weights stay the same Parameter objects; every parameter that is not an adapter factor is
    frozen (``requires_grad=False``), so ``[p for p in model.parameters() if p.requires_grad]`` is exactly
    the adapters. Draws ``A`` from torch's global RNG. Returns the wrapped module names in model order.
    Raises ``ValueError`` if the model already has adapters or a pattern matches no ``Linear``.
    """
    if not isinstance(cfg, LoraConfig):
        raise ValueError(f"apply_lora needs a LoraConfig, got {type(cfg).__name__}")
    model = unwrap_model(model)
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters; apply_lora wraps a plain model once "
                         "(merge_lora first to stack a second adapter on the merged weights)")
    names = _targets(model, cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        _set_module(model, name, LoraLinear(model.get_submodule(name), cfg.rank, cfg.alpha, cfg.dropout))
    return names


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter factors (``A`` then ``B`` of each wrapped module, in model order): what the optimizer gets."""
    return [p for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B)]


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapter factors alone: ``{"<module>.lora_A": (r, in), "<module>.lora_B": (out, r)}`` (detached)."""
    out: dict[str, Tensor] = {}
    for name, m in lora_modules(model).items():
        out[f"{name}.lora_A"], out[f"{name}.lora_B"] = m.lora_A.detach(), m.lora_B.detach()
    return out


def load_lora_state_dict(model: nn.Module, sd: dict[str, Tensor]) -> None:
    """Copy adapter factors from ``sd`` (as :func:`lora_state_dict` returns) into ``model``'s adapters.

    Names and shapes must match exactly; a ``ValueError`` lists what is missing, unexpected or misshapen.
    """
    own = lora_state_dict(model)
    if not own:
        raise ValueError("the model has no LoRA adapters to load into; call apply_lora(model, cfg) first "
                         "(or load_adapters(directory, model), which does both)")
    _check_fits(sd, {k: tuple(v.shape) for k, v in own.items()})
    modules = lora_modules(model)
    with torch.no_grad():
        for name, m in modules.items():
            m.lora_A.copy_(sd[f"{name}.lora_A"])
            m.lora_B.copy_(sd[f"{name}.lora_B"])


def _check_fits(sd: dict[str, Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """``ValueError`` listing missing, unexpected and misshapen adapter factors of ``sd`` against ``shapes``."""
    missing, unexpected = sorted(set(shapes) - set(sd)), sorted(set(sd) - set(shapes))
    bad = [f"{k}: saved {tuple(sd[k].shape)}, model {shapes[k]}"
           for k in sorted(set(shapes) & set(sd)) if tuple(sd[k].shape) != tuple(shapes[k])]
    if missing or unexpected or bad:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else []) \
            + ([f"shape mismatch {bad}"] if bad else [])
        raise ValueError("LoRA adapter weights do not fit this model: " + "; ".join(parts)
                         + "; apply_lora with the rank and targets the adapters were trained with")


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight in place (``W += scale · B A``) and put plain ``Linear``
    modules back, holding the same (now merged) Parameters; ``model.state_dict()`` then has exactly the
    base keys. ``requires_grad`` flags stay as they are (frozen after :func:`apply_lora`)."""
    root = unwrap_model(model)
    modules = lora_modules(root)
    if not modules:
        raise ValueError("the model has no LoRA adapters to merge")
    for name, m in modules.items():
        with torch.no_grad():
            m.weight.add_(m.delta_weight())
        plain = Linear(m.in_features, m.out_features, device="meta")  # no init cost; weight replaced below
        plain.weight = m.weight
        _set_module(root, name, plain)


def merged_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with its adapters merged (``model`` itself unchanged); a plain model is
    copied as is. For consumers that read plain weights, such as the decode engine's packer."""
    twin = copy.deepcopy(unwrap_model(model))
    if has_lora(twin):
        merge_lora(twin)
    return twin


def base_fingerprint(model: nn.Module) -> str:
    """SHA-256 (hex) over the base weights: every state-dict entry except adapter factors, as (name, dtype,
    shape, raw bytes) in name order. The same before and after :func:`apply_lora`, in any process."""
    sd = unwrap_model(model).state_dict()
    base = {k: v.detach().cpu() for k, v in sd.items() if not k.endswith((".lora_A", ".lora_B"))}
    return _digest(base, "")


# --------------------------------------------------------------------------------------------------
# Saving and loading adapters
# --------------------------------------------------------------------------------------------------
def save_adapters(directory: str | os.PathLike, model: nn.Module, cfg: LoraConfig, base_fingerprint: str,
                  force: bool = False) -> Path:
    """Write ``model``'s adapters to ``directory``: ``adapter_model.safetensors`` (the factors) and
    ``adapter_config.json`` (``cfg``, the wrapped modules, ``base_fingerprint``); each file atomically.

    Refuses (``ValueError``) to overwrite existing adapter files unless ``force``. Returns the directory.
    """
    sd = lora_state_dict(model)
    if not sd:
        raise ValueError("the model has no LoRA adapters to save; call apply_lora(model, cfg) first")
    if not isinstance(base_fingerprint, str) or len(base_fingerprint) != 64:
        raise ValueError("base_fingerprint must be the 64-hex-digit string from lmforge.model.lora.base_fingerprint(model)")
    meta = {"format": _FORMAT, "version": _VERSION, "lora": dataclasses.asdict(cfg),
            "modules": list(lora_modules(model)), "base_fingerprint": base_fingerprint}
    return write_adapter_files(directory, sd, meta, {"format": _FORMAT}, force)


def write_adapter_files(directory: str | os.PathLike, tensors: dict[str, Tensor], config: dict[str, Any],
                        metadata: dict[str, str] | None = None, force: bool = False) -> Path:
    """Write ``tensors`` to ``directory/adapter_model.safetensors`` and ``config`` to
    ``directory/adapter_config.json``, each atomically; ``ValueError`` if ``directory`` is a file or either
    file exists and not ``force``. Returns the directory."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ValueError(f"{d} is a file; give a directory for the adapters")
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if (d / name).exists() and not force:
            raise ValueError(f"{d / name} already exists; pass force=True (CLI: --force) to overwrite it")
    data = save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)
    d.mkdir(parents=True, exist_ok=True)
    with atomic_open(d / ADAPTER_WEIGHTS, "wb") as f:
        f.write(data)
    with atomic_open(d / ADAPTER_CONFIG) as f:
        f.write(json.dumps(config, indent=2) + "\n")
    return d


def read_adapter_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``adapter_config.json`` of an lmforge adapter directory (``lora``, ``modules``,
    ``base_fingerprint``); ``ValueError`` if it is missing or not lmforge's format."""
    path = check_input_file(Path(directory) / ADAPTER_CONFIG)
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-save the adapters") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError(f"{path} is not an lmforge LoRA adapter config (no \"format\": \"{_FORMAT}\"); "
                         "PEFT-format adapters load through PEFT")
    if meta.get("version") != _VERSION:
        raise ValueError(f"{path} has adapter format version {meta.get('version')!r}; this lmforge reads "
                         f"version {_VERSION}")
    return meta


def load_adapters(directory: str | os.PathLike, model: nn.Module) -> LoraConfig:
    """Apply LoRA to the plain ``model`` as saved in ``directory`` and load the saved factors.

    Refuses (``ValueError`` naming both fingerprints) when ``model``'s base weights are not those the
    adapters were trained on, and when the saved modules differ from what the saved targets match here.
    Returns the saved :class:`LoraConfig`.
    """
    meta = read_adapter_config(directory)
    try:
        cfg = LoraConfig(**meta["lora"])
    except (TypeError, KeyError) as e:
        raise ValueError(f"{Path(directory) / ADAPTER_CONFIG}: bad \"lora\" section ({e})") from None
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters; load_adapters needs the plain base model "
                         "(to refresh weights of applied adapters use load_lora_state_dict)")
    fp = base_fingerprint(model)
    if fp != meta.get("base_fingerprint"):
        raise ValueError(f"these adapters were trained on another base model: saved base fingerprint "
                         f"{meta.get('base_fingerprint')}, this model's {fp}; load the base run they came from")
    weights = check_input_file(Path(directory) / ADAPTER_WEIGHTS)
    try:
        sd = load_safetensors(weights.read_bytes())
    except Exception as e:  # safetensors raises its own error type on a damaged header
        raise ValueError(f"{weights} is not a readable safetensors file ({e}); re-save the adapters") from None
    names = _targets(unwrap_model(model), cfg)
    if names != meta.get("modules"):
        raise ValueError(f"the saved targets {cfg.targets} select {names} on this model, but the adapters were "
                         f"saved for {meta.get('modules')}")
    check_adapters_fit(model, cfg, sd)
    apply_lora(model, cfg)
    load_lora_state_dict(model, sd)
    return cfg


def check_adapters_fit(model: nn.Module, cfg: LoraConfig, sd: dict[str, Tensor]) -> list[str]:
    """Check, without changing the plain ``model``, that :func:`apply_lora` with ``cfg`` would give adapters
    whose names and shapes are those of ``sd``; returns the module names it would wrap (``ValueError`` if not)."""
    root = unwrap_model(model)
    names = _targets(root, cfg)
    shapes: dict[str, tuple[int, ...]] = {}
    for n in names:
        m = root.get_submodule(n)
        shapes[f"{n}.lora_A"], shapes[f"{n}.lora_B"] = (cfg.rank, m.in_features), (m.out_features, cfg.rank)
    _check_fits(sd, shapes)
    return names
