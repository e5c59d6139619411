"""Stage 3, token ids -> logits: the Llama-style Transformer, its reference primitives, losses and KV cache.

``layers`` holds the reference building blocks written from tensor primitives (the spec); ``fused`` their fast
forms; ``losses`` the fast cross-entropy and the fused LM-head loss; ``blocks`` attention, feed-forward and the
block; ``recipe`` the training-recipe pieces (smear, smeared keys, soft-capping, QK-norm's norm); ``transformer`` the
``ModelConfig`` and ``TransformerLM`` with its reference and fast paths; ``lora`` the LoRA adapters (import ``lmforge.model.lora``). The model sees token ids
only, never text.
"""

from lmforge.model.layers import (Embedding, Linear, RMSNorm, RotaryPositionalEmbedding, SwiGLU,
                                  scaled_dot_product_attention, silu, softmax)
from lmforge.model.losses import cross_entropy, linear_cross_entropy
from lmforge.model.transformer import (CausalSelfAttention, KVCache, ModelConfig, Norm, TransformerBlock, TransformerLM,
                                       cached_projections, flops_per_token, matmul_params_per_token, num_params)

__all__ = ["ModelConfig", "TransformerLM", "TransformerBlock", "CausalSelfAttention", "KVCache", "Norm", "Linear",
           "Embedding", "RMSNorm", "SwiGLU", "RotaryPositionalEmbedding", "softmax", "silu",
           "scaled_dot_product_attention", "cross_entropy", "linear_cross_entropy", "num_params",
           "flops_per_token", "matmul_params_per_token", "cached_projections"]
