"""A Hugging Face `LlamaForCausalLM` folder as cuttable units: embedding, decoder layers, head.

Units are what a Mobius partition cuts between (`scheduler.offload.profile` calls
them layers). Each unit is built alone and loaded alone from the folder's
safetensors (single file or sharded with an index), so a worker holds only the
units of the stages it runs. The project's own checkpoints are exported to this
format by `training.export`; any other `LlamaForCausalLM` folder works too.

Tied input/output embeddings are untied for fine-tuning (the head gets its own
copy of the embedding matrix), because the two live in different stages; the
saved result then has a separate `lm_head.weight` and `tie_word_embeddings: false`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


class OffloadModelError(ValueError):
    """The folder is not a loadable Llama causal LM (what is wrong and how to fix it)."""


class LlamaHead(nn.Module):
    """Final RMSNorm + output projection: hidden states -> logits."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def load_llama_config(model_dir: str | Path):
    """The folder's LlamaConfig (eager checks with a fix hint, before anything heavy loads)."""
    from transformers import LlamaConfig

    folder = Path(model_dir)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise OffloadModelError(f"{folder} has no config.json: give a Hugging Face model folder "
                                f"(e.g. one written by `forgeflow export`)")
    raw = json.loads(config_file.read_text())
    archs = raw.get("architectures") or []
    if raw.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise OffloadModelError(f"{folder} holds a {raw.get('model_type')!r} model ({archs}); the offload "
                                f"executor runs LlamaForCausalLM folders only")
    if not (list(folder.glob("*.safetensors"))):
        raise OffloadModelError(f"{folder} has no *.safetensors weights; re-save the model with "
                                f"save_pretrained(..., safe_serialization=True)")
    config = LlamaConfig.from_pretrained(folder)
    config._attn_implementation = "sdpa"  # what from_pretrained picks on CPU: the reference run matches
    return config


def unit_count(config) -> int:
    return config.num_hidden_layers + 2


def unit_name(config, index: int) -> str:
    if index == 0:
        return "embedding"
    if index == config.num_hidden_layers + 1:
        return "head"
    return f"layer{index - 1}"


def unit_kind(config, index: int) -> str:
    return "embed" if index == 0 else "head" if index == config.num_hidden_layers + 1 else "layer"


def build_unit(config, index: int) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    kind = unit_kind(config, index)
    if kind == "embed":
        return nn.Embedding(config.vocab_size, config.hidden_size)
    if kind == "head":
        return LlamaHead(config)
    return LlamaDecoderLayer(config, index - 1)


def hf_key(config, index: int, local_name: str) -> str:
    """The key of a unit parameter in the HF state dict."""
    kind = unit_kind(config, index)
    if kind == "embed":
        return "model.embed_tokens." + local_name
    if kind == "head":
        return "model." + local_name if local_name.startswith("norm.") else local_name
    return f"model.layers.{index - 1}.{local_name}"


class _SafetensorsFolder:
    """Reads single tensors from a folder's safetensors (one file or an index of shards)."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.where = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            from safetensors import safe_open

            self.where = {}
            for f in sorted(folder.glob("*.safetensors")):
                with safe_open(str(f), "pt") as h:
                    self.where.update({k: f for k in h.keys()})

    def get(self, key: str) -> torch.Tensor | None:
        from safetensors import safe_open

        f = self.where.get(key)
        if f is None:
            return None
        with safe_open(str(f), "pt") as h:
            return h.get_tensor(key)


def load_units(model_dir: str | Path, config, indices, dtype: torch.dtype = torch.float32) -> dict[int, nn.Module]:
    """Build and load the given units from the folder (host memory, `dtype`)."""
    store = _SafetensorsFolder(Path(model_dir))
    units: dict[int, nn.Module] = {}
    for index in indices:
        module = build_unit(config, index).to(dtype)
        state = {}
        for local_name, param in module.state_dict().items():
            key = hf_key(config, index, local_name)
            if key == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
                # Tied: the head is the input embedding, untied here for fine-tuning. A stored
                # lm_head.weight (a checkpoint may carry one that differs) is not what the config
                # says the model is; the reference run (train_without_offload) unties the same way.
                key = "model.embed_tokens.weight"
            tensor = store.get(key)
            if tensor is None:
                raise OffloadModelError(f"{model_dir} has no tensor {key!r} (unit {unit_name(config, index)}); "
                                        f"is it a complete LlamaForCausalLM checkpoint?")
            if tuple(tensor.shape) != tuple(param.shape):
                raise OffloadModelError(f"{key}: shape {tuple(tensor.shape)} in {model_dir}, the config implies "
                                        f"{tuple(param.shape)}")
            state[local_name] = tensor.to(dtype)
        module.load_state_dict(state)
        units[index] = module
    return units


def unit_state_dict(config, index: int, module: nn.Module) -> dict[str, torch.Tensor]:
    """A unit's parameters under their HF names (for writing the fine-tuned folder)."""
    return {hf_key(config, index, k): v.detach().contiguous() for k, v in module.state_dict().items()}


class SequenceContext:
    """What every decoder layer needs besides hidden states: RoPE cos/sin and the causal mask."""

    def __init__(self, config, device: torch.device):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = config
        self.rotary = LlamaRotaryEmbedding(config).to(device)
        self._cache: dict = {}

    def for_hidden(self, hidden: torch.Tensor):
        key = (tuple(hidden.shape), hidden.dtype, hidden.device)
        if key not in self._cache:
            from transformers.masking_utils import create_causal_mask

            position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
            with torch.no_grad():
                cos_sin = self.rotary(hidden, position_ids=position_ids)
            mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                      past_key_values=None, position_ids=position_ids)
            self._cache = {key: (cos_sin, mask, position_ids)}
        return self._cache[key]


def run_unit(kind: str, module: nn.Module, x: torch.Tensor, ctx: SequenceContext,
             params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """One unit forward; `params` substitutes device copies for the module's host parameters."""
    from torch.func import functional_call

    def call(*args, **kwargs):
        if params is None:
            return module(*args, **kwargs)
        return functional_call(module, params, args, kwargs)

    if kind == "embed" or kind == "head":
        return call(x)
    cos_sin, mask, position_ids = ctx.for_hidden(x)
    return call(x, attention_mask=mask, position_embeddings=cos_sin, position_ids=position_ids)
