"""Training throughput of the real trainer step: tokens/s per GPU and model FLOPs utilisation.

    python -m eyas.train.bench --recipe bench-llama3.1-8b        # one GPU
    deepspeed --num_gpus 8 --module eyas.train.bench --recipe bench-llama3.1-8b

Runs `train` with the recipe (synthetic rows of fixed length) and reads the per-step wall times it logs;
the first `--warmup` steps are left out. Model FLOPs per input token, counting matrix products only (the
FLOPs a perfect implementation must do; masked-out attention scores are not counted):
  target forward   2·P_t + 2·L·T·Hq            (P_t: non-embedding weights incl. lm_head; causal QK^T and PV)
  head, k steps    6·(k·P_h + P_fc) + k·6·T·Hq  (P_h: the layer + lm_head, fc once; fwd + bwd, causal part)
MFU = achieved FLOP/s over the dense bf16 peak given (default 989 TFLOP/s, an H100/H200 SXM datasheet).

`--profile N` runs the same under `torch.profiler` and lists the N kernels charged the most device time in a
measured step (off CUDA: the operators a step calls; each is charged what it adds to the end of the work before it,
so time that kernels overlap counts once), which is where a faster step has to come from:

    python -m eyas.train.bench --recipe bench-llama3.1-8b --set model.random_arch=smollm2-135m \\
        --set data.synthetic.batch_size=4 --profile 25
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from eyas.common.cli import HelpFormatter
from eyas.common.profiling import KernelKind, per_step, work_in

from .config import load_recipe
from .target import target_config_of
from .trainer import STEP_RANGE, head_config, train


def flops_per_token(target_cfg, head_cfg, seq_len: int, steps: int) -> float:
    H, L = target_cfg.hidden_size, target_cfg.num_hidden_layers
    q = target_cfg.num_attention_heads * target_cfg.head_dim
    kv = target_cfg.num_key_value_heads * target_cfg.head_dim
    layer = H * (q + 2 * kv) + q * H + 3 * H * target_cfg.intermediate_size
    target = 2 * (L * layer + H * target_cfg.vocab_size) + 2 * 2 * L * (seq_len / 2) * q  # + QK^T and PV
    h = head_cfg.hidden_size
    hq = head_cfg.num_attention_heads * head_cfg.head_dim
    hkv = head_cfg.num_key_value_heads * head_cfg.head_dim
    head_layer = 2 * h * (hq + 2 * hkv) + hq * h + 3 * h * head_cfg.intermediate_size
    per_step = head_layer + h * head_cfg.draft_vocab_size
    fc = 3 * head_cfg.target_hidden_size * h
    attention = 3 * 2 * 2 * (seq_len / 2) * hq  # forward + backward (2x) of the causal part
    return target + 6 * (steps * per_step + fc) + steps * attention


def step_kernels(events, warmup: int) -> tuple[int, list[KernelKind]]:
    """The device work of the training steps after the first `warmup` (off CUDA: the operators a step calls), from a
    profiler's events -> (steps, each kind's share of a step, the most charged first)."""
    steps = sorted((e for e in events if e.name == STEP_RANGE and e.device_type == DeviceType.CPU),
                   key=lambda e: e.time_range.start)[warmup:]
    return len(steps), per_step(work_in(events, steps), len(steps))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eyas.train.bench", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--recipe", default="bench-llama3.1-8b", help="a recipe name or YAML file, as train-eagle's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, as train-eagle's --set (repeatable)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles, allocator)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the GPU's dense bf16 peak in TFLOPS, for MFU (an H100's or H200's)")
    parser.add_argument("--output", type=Path, help="run directory (default: a temporary one)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="run under torch.profiler and list a measured step's N costliest kernels (the step "
                        "times then carry the profiler's overhead)")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.set)
    synthetic = recipe.data.synthetic
    if synthetic is None:
        parser.error("the benchmark needs a recipe with synthetic rows of fixed length")
    if args.warmup >= recipe.optim.total_steps:  # found out now, not after the whole run has nothing to measure
        parser.error(f"--warmup {args.warmup} leaves none of the recipe's {recipe.optim.total_steps} steps to measure")
    if recipe.model.random_target is not None:
        parser.error("the benchmark needs model.random_arch or model.target")
    target_cfg = target_config_of(recipe.model)
    head_cfg = head_config(recipe.model, target_cfg)
    with tempfile.TemporaryDirectory() as tmp:
        output = args.output or Path(tmp)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) if args.profile else contextlib.nullcontext() as profiler:
            train(recipe, output)
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        lines = (output / "metrics.jsonl").read_text().splitlines()
    seconds = [r["seconds"] for r in map(json.loads, lines) if r["split"] == "train"][args.warmup :]
    step = statistics.median(seconds)
    tokens_per_gpu = synthetic.batch_size * synthetic.seq_len * recipe.optim.grad_accum / step
    flops = flops_per_token(target_cfg, head_cfg, synthetic.seq_len, recipe.ttt.steps)
    tflops = flops * tokens_per_gpu / 1e12
    result = {
        "recipe": args.recipe, "seq_len": synthetic.seq_len, "ttt_steps": recipe.ttt.steps,
        "median_step_s": step, "tokens_per_s_per_gpu": tokens_per_gpu, "gflop_per_token": flops / 1e9,
        "tflops_per_gpu": tflops, "mfu": tflops / args.peak_tflops, "peak_tflops": args.peak_tflops,
        "measured_steps": len(seconds),
    }
    print(json.dumps(result))
    print(f"{tokens_per_gpu:,.0f} tokens/s per GPU, {flops / 1e9:.1f} GFLOP/token, {tflops:.0f} TFLOP/s, "
          f"MFU {100 * result['mfu']:.1f}% of {args.peak_tflops:.0f} (median of {len(seconds)} steps of {step:.3f} s)")
    if args.profile:
        steps, kernels = step_kernels(profiler.events(), args.warmup)
        unit, calls = ("kernels", "launches") if torch.cuda.is_available() else ("operators", "calls")
        print(f"under the profiler; {unit} of a step (mean of {steps} steps): "
              f"{sum(k.launches for k in kernels):.0f} {calls}, {sum(k.charged_us for k in kernels) / 1e3:.1f} ms busy")
        for name, launches, us, charged in kernels[: args.profile]:
            print(f"  {launches:7.1f}x {us / 1e3:9.3f} ms, charged {charged / 1e3:9.3f}  {name[:100]}")


if __name__ == "__main__":
    main()
