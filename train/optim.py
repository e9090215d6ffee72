"""Optimizer, learning-rate schedule and the DeepSpeed config generated from a recipe."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from .config import TrainRecipe


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr before optimizer step `step` (0-based): linear warmup over `warmup` steps,
    then a cosine from 1 down to `min_ratio` at `total`. Example, warmup 2, total 6, min 0:
    steps 0..5 -> 0.5, 1.0, 1.0, 0.85, 0.5, 0.15."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(recipe: TrainRecipe, model: nn.Module):
    o = recipe.optim
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    min_ratio = o.min_lr / o.lr if o.lr else 0.0
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, o.warmup_steps, o.total_steps, min_ratio)
    )
    return optimizer, schedule


def resume_schedule(schedule: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Sets the lr of `schedule`'s optimizer to the schedule's own at optimizer step `step`. A checkpoint's optimizer
    holds the lr of the schedule it was trained under, and its saved schedule state leaves the lambda out, so a run
    resumed under another shape (a finished run trained further with a larger optim.total_steps) would take its first
    step at the old lr: 0 after a cosine down to min_lr 0."""
    schedule.last_epoch = step - 1
    with warnings.catch_warnings():  # the step here sets the lr; no optimizer step was skipped
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()` before `optimizer.step()`")
        schedule.step()


def deepspeed_config(recipe: TrainRecipe, micro_batch_size: int, bf16: bool) -> dict[str, Any]:
    """DeepSpeed's JSON config: ZeRO stage, precision, accumulation and clipping come from the recipe;
    `deepspeed.extra` is merged last, mapping into mapping (`{zero_optimization: {reduce_bucket_size: N}}` keeps
    the stage), anything else replacing."""
    zero = {"stage": recipe.deepspeed.zero_stage}
    if recipe.deepspeed.zero_stage == 3:
        # DeepSpeed's memory-efficient linear replaces torch.nn.functional.linear for the whole process, for good
        # (every model in it would run DeepSpeed's autograd function); torch's keeps the gathered head weights
        # alive from forward to backward instead, 2.8 GB for a 70B target's head in bf16.
        zero["memory_efficient_linear"] = False
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": recipe.optim.grad_accum,
        "gradient_clipping": recipe.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,  # the trainer logs
        "wall_clock_breakdown": False,
    }
    return _merge(config, recipe.deepspeed.extra)


def _merge(base: dict, extra: dict) -> dict:
    both = {k for k, v in extra.items() if isinstance(v, dict) and isinstance(base.get(k), dict)}
    return {**base, **extra, **{k: _merge(base[k], extra[k]) for k in both}}
