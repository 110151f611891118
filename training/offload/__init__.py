"""Offloaded fine-tuning (Mobius): the model in host memory, stages swapped through the device.

    spec      the fine-tuning job file of `forgeflow finetune` (YAML, validated)
    units     a HF LlamaForCausalLM folder as cuttable units (embedding, layers, head), loaded one by one
    device    the device memory budget (enforced; the CPU stand-in for a GPU) and the prefetcher
    executor  the fine-tuning loop of one worker (stage s on worker s mod W) and the no-offload reference
    worker    `python -m training.offload.worker RUN.json` under torchrun
    launch    run W local workers under torchrun and collect their reports
"""
