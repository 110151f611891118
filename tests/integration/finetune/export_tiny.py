"""Build the project's own tiny Llama (megatron GPTModel) and export it with training.export: the
folder `forgeflow finetune` starts from. Run as a script (megatron needs its own process)."""

import sys
from pathlib import Path

out = Path(sys.argv[1])

from training.config import ModelConfig, TrainingConfig  # noqa: E402
from training.corpus import Document  # noqa: E402
from training.data import save_hf_tokenizer, train_tokenizer  # noqa: E402
from training.export import megatron_state_dict_to_llama, write_hf_folder  # noqa: E402
from training.model import build_model, init_distributed, shutdown_distributed  # noqa: E402

model_cfg = ModelConfig(num_layers=6, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                        vocab_size=320, seq_length=32, untie_embeddings_and_output_weights=True)
training_cfg = TrainingConfig(global_batch_size=4, steps=1, precision="fp32")
docs = [Document(f"doc{i}", f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20) for i in range(30)]
tokenizer = train_tokenizer(docs, model_cfg.vocab_size)
save_hf_tokenizer(tokenizer, out / "tokenizer", model_cfg.seq_length)
init_distributed()
model = build_model(model_cfg, training_cfg)
write_hf_folder(megatron_state_dict_to_llama(model.state_dict(), model_cfg), model_cfg, out / "hf", out / "tokenizer",
                provenance={"job": "tiny-offload-test", "step": 0})
shutdown_distributed()
