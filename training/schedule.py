"""Learning-rate schedule: linear warmup, then cosine decay to min_lr.

A pure function of the step (no state), so a resumed run gets exactly the rate an
uninterrupted one had — nothing to checkpoint. megatron's OptimizerParamScheduler
computes the same curve but counts steps internally and must be saved and restored;
a pure function is one less piece of state to get wrong on resume.

    step < warmup:            lr * (step + 1) / warmup
    warmup <= step < decay:   min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2,
                              progress = (step - warmup) / (decay - warmup)
    step >= decay:            min_lr
where decay = lr_decay_steps or steps, and `step` counts from 0.
"""

from __future__ import annotations

import math

from training.config import TrainingConfig


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """The learning rate for (0-based) optimizer step `step`."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    warmup = cfg.warmup_steps
    decay = cfg.lr_decay_steps or cfg.steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if step >= decay or decay <= warmup:
        return cfg.min_lr
    progress = (step - warmup) / (decay - warmup)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def apply_schedule(optimizer, step: int, cfg: TrainingConfig) -> float:
    """Set every param group's lr and weight decay for `step`; returns the lr.

    Honours megatron's per-group multipliers (`lr_mult`, `wd_mult`; wd_mult is 0 for
    norm weights), as megatron's own scheduler does.
    """
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 1.0)
    return lr
