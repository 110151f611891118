"""The megatron -> HF Llama weight mapping on labelled tensors (no model needed)."""

from __future__ import annotations

import pytest
import torch

from training.config import ModelConfig
from training.export import ExportError, megatron_state_dict_to_llama, split_qkv

CFG = ModelConfig(num_layers=1, hidden_size=24, num_attention_heads=6, num_query_groups=2,
                  ffn_hidden_size=10, vocab_size=300, seq_length=8)


def _labelled_qkv(cfg: ModelConfig) -> torch.Tensor:
    """Rows labelled 1000*group + 100*slot + row-in-head, in megatron's grouped order."""
    per_group, d = cfg.num_attention_heads // cfg.kv_heads, cfg.head_dim
    rows = [1000 * g + 100 * slot + r
            for g in range(cfg.kv_heads) for slot in range(per_group + 2) for r in range(d)]
    return torch.tensor(rows, dtype=torch.float32).unsqueeze(1).repeat(1, cfg.hidden_size)


def test_qkv_split_follows_query_groups():
    per_group, d = 3, CFG.head_dim
    q, k, v = split_qkv(_labelled_qkv(CFG), CFG)
    assert q.shape == (6 * d, 24) and k.shape == v.shape == (2 * d, 24)
    for head in range(6):  # HF: query head h attends with kv head h // (heads / groups)
        group, slot = divmod(head, per_group)
        assert q[head * d:(head + 1) * d, 0].tolist() == [1000 * group + 100 * slot + r for r in range(d)]
    for group in range(2):
        assert k[group * d:(group + 1) * d, 0].tolist() == [1000 * group + 300 + r for r in range(d)]
        assert v[group * d:(group + 1) * d, 0].tolist() == [1000 * group + 400 + r for r in range(d)]


def _megatron_sd(cfg: ModelConfig, te_names: bool = False) -> dict:
    h, f = cfg.hidden_size, cfg.ffn_size
    fc1 = torch.cat([torch.full((f, h), 1.0), torch.full((f, h), 2.0)])  # gate rows 1, up rows 2
    layer = "decoder.layers.0."
    norms = ({layer + "self_attention.linear_qkv.layer_norm_weight": torch.full((h,), 3.0),
              layer + "mlp.linear_fc1.layer_norm_weight": torch.full((h,), 4.0)} if te_names else
             {layer + "input_layernorm.weight": torch.full((h,), 3.0),
              layer + "pre_mlp_layernorm.weight": torch.full((h,), 4.0)})
    return {
        "embedding.word_embeddings.weight": torch.zeros(cfg.vocab_size, h),
        layer + "self_attention.linear_qkv.weight": _labelled_qkv(cfg),
        layer + "self_attention.linear_qkv._extra_state": None,
        layer + "self_attention.linear_proj.weight": torch.full((h, h), 5.0),
        layer + "mlp.linear_fc1.weight": fc1,
        layer + "mlp.linear_fc2.weight": torch.full((h, f), 6.0),
        **norms,
        "decoder.final_layernorm.weight": torch.full((h,), 7.0),
        "output_layer.weight": torch.full((cfg.vocab_size, h), 8.0),
    }


@pytest.mark.parametrize("te_names", [False, True])
def test_full_mapping_names_and_halves(te_names):
    out = megatron_state_dict_to_llama(_megatron_sd(CFG, te_names), CFG)
    p = "model.layers.0."
    assert out[p + "mlp.gate_proj.weight"].unique().tolist() == [1.0]  # silu(first half)
    assert out[p + "mlp.up_proj.weight"].unique().tolist() == [2.0]
    assert out[p + "input_layernorm.weight"].unique().tolist() == [3.0]
    assert out[p + "post_attention_layernorm.weight"].unique().tolist() == [4.0]
    assert out[p + "self_attn.o_proj.weight"].unique().tolist() == [5.0]
    assert out[p + "mlp.down_proj.weight"].unique().tolist() == [6.0]
    assert out["model.norm.weight"].unique().tolist() == [7.0]
    assert out["lm_head.weight"].unique().tolist() == [8.0]
    assert all(t.is_contiguous() for t in out.values())


def test_tied_embeddings_have_no_lm_head():
    tied = CFG.model_copy(update={"untie_embeddings_and_output_weights": False})
    sd = _megatron_sd(tied)
    del sd["output_layer.weight"]
    assert "lm_head.weight" not in megatron_state_dict_to_llama(sd, tied)


def test_wrong_ffn_size_is_named():
    wrong = CFG.model_copy(update={"ffn_hidden_size": 12})
    with pytest.raises(ExportError, match="expected 2 x ffn_hidden_size"):
        megatron_state_dict_to_llama(_megatron_sd(CFG), wrong)
