"""`forgeflow export`: a megatron-core checkpoint -> a Hugging Face `LlamaForCausalLM` folder.

The folder (config.json, model.safetensors, generation_config.json, the job's
tokenizer files, forgeflow.json with provenance) loads offline with
`transformers.AutoModelForCausalLM.from_pretrained(path)` and with vLLM.

Weight mapping, megatron GPTModel (local or Transformer-Engine layer spec) -> HF Llama:

    embedding.word_embeddings.weight             model.embed_tokens.weight
    decoder.layers.i.input_layernorm.weight      model.layers.i.input_layernorm.weight
      (TE spec: ...linear_qkv.layer_norm_weight)
    decoder.layers.i.self_attention.linear_qkv   q_proj, k_proj, v_proj — megatron stores the
                                                 rows grouped by KV group: for each of the G
                                                 groups, its H/G query heads, then its key
                                                 head, then its value head (head_dim rows each)
    decoder.layers.i.self_attention.linear_proj  o_proj
    decoder.layers.i.pre_mlp_layernorm.weight    post_attention_layernorm
      (TE spec: ...mlp.linear_fc1.layer_norm_weight)
    decoder.layers.i.mlp.linear_fc1              [gate_proj; up_proj] — megatron's gated
                                                 unit computes silu(first half) * second half
    decoder.layers.i.mlp.linear_fc2              down_proj
    decoder.final_layernorm.weight               model.norm.weight
    output_layer.weight                          lm_head.weight (absent when tied)

No RoPE permutation is needed: megatron's default (non-interleaved) rotary embedding
rotates halves (rotate_half) exactly like HF Llama, with the same inverse frequencies
1/theta^(2i/d). RMSNorm (x / sqrt(mean(x^2) + eps) * w) is the same in both.

Checkpoints (the one "sharded" format, local or s3://, any TP/PP layout) are read
by training.checkpoint_reader, which loads them onto a one-process, whole-matrix
layout through the same resharding loader a resuming job uses. The checkpoint is a
CheckpointRef located once per export (a ref is read as it is; a path is located
first): one manifest read, then the shards.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from checkpoint.manifest import CheckpointRef
from infra.storage import Storage
from training.config import JobSpec, ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class ExportError(RuntimeError):
    """A checkpoint could not be exported (missing, wrong shape, tokenizer absent)."""


# --- the weight mapping -----------------------------------------------------------------------

def _first(state_dict: dict, *names: str) -> torch.Tensor:
    for name in names:
        if name in state_dict:
            return state_dict[name]
    raise ExportError(f"megatron state dict has none of {names}; is it a GPTModel's state dict?")


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused QKV weight [G*(H/G+2)*d, hidden] -> (q [H*d], k [G*d], v [G*d])."""
    groups, heads, d = cfg.kv_heads, cfg.num_attention_heads, cfg.head_dim
    per_group = heads // groups
    grouped = qkv.reshape(groups, per_group + 2, d, qkv.shape[-1])
    q = grouped[:, :per_group].reshape(heads * d, -1)
    k = grouped[:, per_group].reshape(groups * d, -1)
    v = grouped[:, per_group + 1].reshape(groups * d, -1)
    return q, k, v


def megatron_state_dict_to_llama(state_dict: dict, model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A (tensor-parallel-1) megatron GPTModel state dict as HF LlamaForCausalLM weights."""
    sd = {k.removeprefix("module."): v for k, v in state_dict.items()
          if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    f = model_cfg.ffn_size
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"]}
    for i in range(model_cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = sd[src + "self_attention.linear_qkv.weight"]
        q, k, v = split_qkv(qkv, model_cfg)
        fc1 = sd[src + "mlp.linear_fc1.weight"]
        if fc1.shape[0] != 2 * f:
            raise ExportError(f"{src}mlp.linear_fc1 has {fc1.shape[0]} rows, expected 2 x "
                              f"ffn_hidden_size ({f}) for SwiGLU; does the spec match the model?")
        out.update({
            dst + "input_layernorm.weight": _first(
                sd, src + "input_layernorm.weight", src + "self_attention.linear_qkv.layer_norm_weight"),
            dst + "self_attn.q_proj.weight": q,
            dst + "self_attn.k_proj.weight": k,
            dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": sd[src + "self_attention.linear_proj.weight"],
            dst + "post_attention_layernorm.weight": _first(
                sd, src + "pre_mlp_layernorm.weight", src + "mlp.linear_fc1.layer_norm_weight"),
            dst + "mlp.gate_proj.weight": fc1[:f],
            dst + "mlp.up_proj.weight": fc1[f:],
            dst + "mlp.down_proj.weight": sd[src + "mlp.linear_fc2.weight"],
        })
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    if model_cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = sd["output_layer.weight"]
    # Own, contiguous storage: safetensors refuses views and shared memory.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def llama_config(model_cfg: ModelConfig, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None,
                 dtype: str = "float32"):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.kv_heads,
        head_dim=model_cfg.head_dim,
        max_position_embeddings=model_cfg.seq_length,
        rms_norm_eps=model_cfg.norm_epsilon,
        rope_theta=model_cfg.rope_theta,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=not model_cfg.untie_embeddings_and_output_weights,
        initializer_range=model_cfg.init_method_std,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype=dtype,
    )


# --- writing the folder -----------------------------------------------------------------------

def _tokenizer_ids(tokenizer_dir: Path) -> dict[str, int | None]:
    from tokenizers import Tokenizer

    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))

    def token_id(name: str) -> int | None:
        token = config.get(name)
        if isinstance(token, dict):  # AddedToken serialisation
            token = token.get("content")
        return tok.token_to_id(token) if token else None

    return {"bos_token_id": token_id("bos_token"), "eos_token_id": token_id("eos_token"),
            "pad_token_id": token_id("pad_token")}


def write_hf_folder(llama_state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig,
                    out_dir: str | Path, tokenizer_dir: str | Path, dtype: str = "float32",
                    provenance: dict | None = None) -> Path:
    """Write a LlamaForCausalLM folder atomically (temp folder, then rename)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaForCausalLM

    if dtype not in _DTYPES:
        raise ExportError(f"dtype {dtype!r}: use one of {', '.join(_DTYPES)}")
    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    missing = [n for n in _TOKENIZER_FILES[:2] if not (tokenizer_dir / n).is_file()]
    if missing:
        raise ExportError(f"{tokenizer_dir}: no {', '.join(missing)}; run `forgeflow prepare "
                          "CONFIG` for this job or pass the tokenizer directory")
    ids = _tokenizer_ids(tokenizer_dir)
    config = llama_config(model_cfg, dtype=dtype, **ids)

    # Check names and shapes against the real HF class before writing anything.
    with torch.device("meta"):
        expected = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    got = {k: v.shape for k, v in llama_state_dict.items()}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or sorted(k for k in got if got[k] != expected[k])
        raise ExportError(f"converted weights do not fit LlamaForCausalLM: {wrong[:5]}")

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.to(_DTYPES[dtype]) for k, v in llama_state_dict.items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    # transformers 5 writes rope_theta under rope_parameters only; older readers (vLLM's
    # pinned transformers 4.x) look for the top-level key and would silently use 10000.
    # Likewise they read the weights' dtype from "torch_dtype".
    config_json = json.loads((tmp / "config.json").read_text())
    config_json.setdefault("rope_theta", model_cfg.rope_theta)
    config_json.setdefault("torch_dtype", dtype)  # the 4.x name of "dtype"
    (tmp / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    GenerationConfig(**ids).save_pretrained(tmp)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, tmp / name)
    # The model's context, whatever sequence length the data was first prepared for.
    tokenizer_config = json.loads((tmp / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = model_cfg.seq_length
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (tmp / "forgeflow.json").write_text(json.dumps(provenance or {}, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def export_hf(checkpoint: str | Path | CheckpointRef, out_dir: str | Path, spec: JobSpec,
              tokenizer_dir: str | Path | None = None, dtype: str = "float32", *,
              storage: Storage | None = None) -> Path:
    """Convert a checkpoint the worker wrote into a LlamaForCausalLM folder.

    `checkpoint`: a located CheckpointRef (read as it is), or what a person types: a step
    directory (`step-N/`, local or s3://) or a checkpoint root (its newest committed step),
    located here, once. `storage`: an open storage at the ref's root to read through.
    `tokenizer_dir` defaults to `{spec.data.data_dir}/tokenizer`.
    """
    from training.checkpoint_reader import CheckpointReadError, locate_checkpoint, read_model_state_dict

    tokenizer_dir = Path(tokenizer_dir or Path(spec.data.data_dir) / "tokenizer")
    try:
        ref = locate_checkpoint(checkpoint, spec)
        megatron_sd, trainer_state = read_model_state_dict(ref, spec, storage=storage)
    except CheckpointReadError as e:
        raise ExportError(str(e)) from e
    llama_sd = megatron_state_dict_to_llama(megatron_sd, spec.model)
    provenance = {
        "job": spec.name,
        "checkpoint": ref.step_url,
        "checkpoint_ref": ref.to_dict(),
        "checkpoint_format": ref.format,
        "step": trainer_state.get("step", ref.step),
        "config_hash": spec.config_hash(),
        "checkpoint_config_hash": trainer_state.get("config_hash"),
        "dtype": dtype,
    }
    return write_hf_folder(llama_sd, spec.model, out_dir, tokenizer_dir, dtype, provenance)
