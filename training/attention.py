"""Core attention: megatron's unfused kernel or torch's fused scaled_dot_product_attention.

    spec = gpt_layer_spec("sdpa")     # megatron's local layer spec, core attention via SDPA

`training.attention` picks the kernel (`training.config.resolve_attention`: auto is sdpa
on Ampere-or-newer GPUs in half precision, local elsewhere). Only the core attention
differs, so both build the same parameters under the same names: a checkpoint written
with one resumes with the other, and the Hugging Face export is unchanged.

megatron-core 0.16 without Transformer Engine has no fused attention for training (its
flash-attn imports serve inference with a KV cache), so `SDPAttention` is the fused path
here: torch picks FlashAttention-2, memory-efficient or cuDNN attention on GPUs, and a
math or flash CPU kernel on CPU.
"""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from training.config import ResolvedAttention


class SDPAttention(DotProductAttention):
    """megatron's core-attention interface ([s, b, heads, head_dim] in, [s, b, hidden] out)
    computed by `torch.nn.functional.scaled_dot_product_attention`.

    Grouped-query attention passes k/v with their own head count (`enable_gqa`), so the
    repeated k/v the unfused kernel saves are never built. Causal masking is the kernel's
    own (`is_causal`) unless megatron hands an explicit mask.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, *args, **kwargs)
        if self.config.softmax_type != "vanilla" or self.scale_mask_softmax.window_size is not None:
            raise ValueError(
                "training.attention=sdpa supports vanilla softmax without sliding windows; "
                "set training.attention: local for softmax_type/window_size variants")
        # DotProductAttention divides the scale by the layer number when query-key layer
        # scaling is on and multiplies it back inside its softmax; SDPA applies it once.
        self.scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("training.attention=sdpa takes no packed sequences or attention bias; "
                             "set training.attention: local")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:
            if mask_type != AttnMaskType.causal:
                raise ValueError(f"training.attention=sdpa got attention mask type {mask_type} "
                                 "without a mask; set training.attention: local")
            mask, causal = None, True
        else:
            mask, causal = ~attention_mask, False  # megatron's mask is True where masked out
        dropout = self.attention_dropout.p if self.training else 0.0
        kwargs = dict(attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.scale,
                      enable_gqa=q.size(1) != k.size(1))
        if dropout > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        # [b, n, s, d] -> [s, b, n * d]
        s, b = context.size(2), context.size(0)
        return context.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


def gpt_layer_spec(attention: ResolvedAttention):
    """megatron-core's local GPT layer spec (RMSNorm), core attention per `attention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "local":
        return spec
    if attention != "sdpa":
        raise ValueError(f"unknown attention kernel {attention!r}; use local or sdpa")
    self_attention = spec.submodules.self_attention
    attention_submodules = dataclasses.replace(self_attention.submodules, core_attention=SDPAttention)
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=dataclasses.replace(self_attention, submodules=attention_submodules)))

