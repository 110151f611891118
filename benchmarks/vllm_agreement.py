"""vLLM vs transformers on the same exported checkpoint: greedy agreement and tokens/s (GPU only).

Runs one suite (greedy generation: arith-em and a HumanEval subset; log-likelihood:
capitals-mc) through `evalsuite.runner.evaluate` twice on the same Hugging Face
folder — once with the transformers backend, once with vLLM, each trial in its own
process on the slot's GPU — and compares the records the two wrote:

- `generation_agreement`: share of generation requests whose greedy text is identical;
- `greedy_flag_agreement` / `max_logprob_diff`: log-likelihood records (same continuation
  judged greedy; largest absolute difference of summed log-probabilities);
- `tokens_per_s_vllm` / `tokens_per_s_transformers`: generated tokens (re-tokenised
  outputs) per second of inference, from the trials' own timings.

The baseline is the transformers backend on the same GPU, batch 8: the reference
implementation both must agree with. bf16 kernels differ, so a few generations may
part ways after a near-tie; agreement is reported, not asserted.

    .venv/bin/python benchmarks/vllm_agreement.py [--model HF_FOLDER] [--device cuda:0]

Without CUDA or vLLM (`pip install forgeflow[gpu]` on a GPU node) it says so and prints
nulls. Not yet run: no GPU machine was available when it was written.

`--smoke` (no GPU, seconds): the transformers half on CPU (fp32, SMOKE_SUITE: one or two samples per
dataset; make_tiny_checkpoint's default 2-layer, 64-wide model) through the same `run_backend`, and `compare` reading its records against themselves
to check the pairing and re-tokenising; only `tokens_per_s_transformers` (CPU) is reported, the
vLLM and agreement keys stay null. The last line's keys: HEADLINE_KEYS.
"""

from __future__ import annotations

import json
import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.headline import checked_headline  # noqa: E402

HEADLINE_KEYS = ("generation_agreement", "greedy_flag_agreement", "max_logprob_diff", "tokens_per_s_vllm",
                 "tokens_per_s_transformers")

SUITE = """
name: agreement
backend: BACKEND
backend_options: {OPTIONS}
slots: 1
devices: [DEVICE]
isolation: process
metric_workers: 1
datasets:
  - name: arith-em
  - name: capitals-mc
  - name: humaneval
    options: {limit: 32, max_new_tokens: 128}
"""
SMOKE_SUITE = SUITE.replace("options: {limit: 32, max_new_tokens: 128}", "options: {limit: 1, max_new_tokens: 8}") \
    .replace("- name: arith-em\n", "- name: arith-em\n    options: {limit: 2}\n") \
    .replace("- name: capitals-mc\n", "- name: capitals-mc\n    options: {limit: 2}\n")
# the default model (no --model): a tiny random Llama; --smoke's is make_tiny_checkpoint's smallest
MODEL_SHAPE = {"hidden": 256, "layers": 4}


def run_backend(model: Path, backend: str, device: str, work: Path, suite: str = SUITE,
                dtype: str = "bfloat16") -> tuple[Path, float]:
    from evalsuite.history import RuntimeHistory
    from evalsuite.runner import evaluate
    from evalsuite.suite import load_suite

    # SUITE's braces hold them: `backend_options: {OPTIONS}` (the braces here made it {{...}}, not YAML)
    options = f"batch_size: 8, dtype: {dtype}" if backend == "transformers" else f"dtype: {dtype}"
    suite_file = work / f"suite-{backend}.yaml"
    suite_file.write_text(suite.replace("BACKEND", backend).replace("OPTIONS", options).replace("DEVICE", device))
    out = work / backend
    report = evaluate(str(model), load_suite(str(suite_file), overrides={"preload_root": str(work / "shm")}), out,
                      history=RuntimeHistory(work / "history.json"), echo=print)
    if report.failed_datasets:
        raise SystemExit(f"{backend}: failed datasets {report.failed_datasets}")
    generate_s = sum(t.seconds for o in report.outcomes if o.result for t in o.result.shards
                     if t.dataset in ("arith-em", "humaneval"))
    return out, generate_s


def compare(model: Path, a: Path, b: Path) -> dict[str, float]:
    from transformers import AutoTokenizer

    from evalsuite.records import GenerationRecord, read_records

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    same = total = flags_same = flags = 0
    max_diff = 0.0
    tokens = {"a": 0, "b": 0}
    for shard in sorted((a / "generations").rglob("shard-*.jsonl")):
        other = b / shard.relative_to(a)
        for ra, rb in zip(read_records(shard), read_records(other), strict=True):
            if isinstance(ra, GenerationRecord):
                total += 1
                same += ra.outputs == rb.outputs
                tokens["a"] += sum(len(tokenizer(t)["input_ids"]) for t in ra.outputs)
                tokens["b"] += sum(len(tokenizer(t)["input_ids"]) for t in rb.outputs)
            else:
                flags += 1
                flags_same += ra.is_greedy == rb.is_greedy
                max_diff = max(max_diff, abs(ra.logprob - rb.logprob))
    return {"generation_agreement": same / max(1, total), "greedy_flag_agreement": flags_same / max(1, flags),
            "max_logprob_diff": max_diff, "tokens_transformers": tokens["a"], "tokens_vllm": tokens["b"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="exported Hugging Face folder (default: a tiny random Llama)")
    parser.add_argument("--device", default="cuda:0", help="the slot's GPU")
    parser.add_argument("--smoke", action="store_true",
                        help="no GPU: the transformers half on CPU on a few samples, records paired with themselves")
    args = parser.parse_args()
    headline = dict.fromkeys(HEADLINE_KEYS)
    import torch

    work = Path(tempfile.mkdtemp(prefix="vllm-agreement-"))
    model = Path(args.model) if args.model else None
    if model is None and (args.smoke or torch.cuda.is_available()):
        from testing.tiny_checkpoint import make_tiny_checkpoint

        model = make_tiny_checkpoint(work / "model", **({} if args.smoke else MODEL_SHAPE))
    if args.smoke:
        hf_out, hf_s = run_backend(model, "transformers", "cpu", work, SMOKE_SUITE, dtype="float32")
        figures = compare(model, hf_out, hf_out)
        print(f"transformers on CPU: {figures['tokens_transformers']} tokens in {hf_s:.2f} s of inference; "
              f"its records paired with themselves agree {figures['generation_agreement']:.0%} (a harness check)")
        headline.update(tokens_per_s_transformers=round(figures["tokens_transformers"] / hf_s, 1))
        print(json.dumps(checked_headline(headline, HEADLINE_KEYS)), flush=True)
        return 0
    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        print("needs a CUDA GPU and vLLM (pip install forgeflow[gpu] on a GPU node); nothing measured")
        print(json.dumps(checked_headline(headline, HEADLINE_KEYS)), flush=True)
        return 0
    hf_out, hf_s = run_backend(model, "transformers", args.device, work)
    vllm_out, vllm_s = run_backend(model, "vllm", args.device, work)
    figures = compare(model, hf_out, vllm_out)
    print(f"greedy generations identical: {figures['generation_agreement']:.1%}; log-likelihood greedy flags "
          f"agree: {figures['greedy_flag_agreement']:.1%}; max |logprob diff| {figures['max_logprob_diff']:.4f}")
    print(f"tokens/s: vLLM {figures['tokens_vllm'] / vllm_s:.0f}, transformers "
          f"{figures['tokens_transformers'] / hf_s:.0f}")
    headline.update(generation_agreement=round(figures["generation_agreement"], 4),
                    greedy_flag_agreement=round(figures["greedy_flag_agreement"], 4),
                    max_logprob_diff=round(figures["max_logprob_diff"], 5),
                    tokens_per_s_vllm=round(figures["tokens_vllm"] / vllm_s, 1),
                    tokens_per_s_transformers=round(figures["tokens_transformers"] / hf_s, 1))
    print(json.dumps(checked_headline(headline, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
