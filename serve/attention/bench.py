"""Attention-kernel benchmark: the Triton backend, and FlashInfer's when installed, against the torch reference on
Llama-3.1-8B shapes (Hq 32, Hkv 8, D 128, bf16), one layer.

    python -m eyas.serve.attention.bench [--block-size 16] [--num-splits N]

Times one `attend` call of each backend (the k/v write included; view building and FlashInfer's planning, done
once per forward, excluded) two ways: the eager call with triton.testing.do_bench (median, L2 flushed between
calls), which small cases spend launching kernels from the host; and its GPU time, the profiler's sum of the
call's kernels (what a CUDA graph replays). The Triton kernel's KV-read bandwidth is over its GPU time: the
distinct K and V bytes the view covers, B * (prefix + W) * Hkv * D * 2 * 2, per second (a causal prefill re-reads
its window once per row tile, so there it is a lower bound).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys

import torch

from ..kv_cache import KVPool
from .torch_sdpa import TorchPagedAttention

HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16

# name, B, T, W, prefix
CASES = [
    ("decode", 1, 1, 1, 1024),
    ("decode", 1, 1, 1, 4096),
    ("decode", 1, 1, 1, 8192),
    ("verify", 1, 48, 48, 1024),
    ("decode", 8, 1, 1, 1024),
    ("decode", 64, 1, 1, 1024),
    ("draft", 1, 8, 40, 1024),
    ("prefill", 1, 2048, 2048, 0),
    ("prefill", 1, 2048, 2048, 2048),
]


def make_view(B: int, T: int, W: int, prefix: int, block_size: int):
    """Every row at `prefix` cached tokens, in randomly placed blocks; the window's queries see every earlier
    window key (causal: a chain for verify and draft, which costs the same as a tree)."""
    blocks = -(-(prefix + W) // block_size)
    pool = KVPool(1, B * blocks, block_size, HKV, D, DTYPE, "cuda")
    pool.k[0].normal_()
    pool.v[0].normal_()
    block_table = torch.randperm(B * blocks, device="cuda").view(B, blocks).int()
    prefix_lens = torch.full((B,), prefix, dtype=torch.int32, device="cuda")
    window_mask = torch.ones(T, W, dtype=torch.bool, device="cuda").tril(W - T).expand(B, T, W)
    qkv = [torch.randn(B, T, h, D, dtype=DTYPE, device="cuda") for h in (HQ, HKV, HKV)]
    return (pool, block_table, prefix_lens, window_mask), qkv


def gpu_us(fn, reps: int = 20) -> float:
    """Microseconds per call spent in GPU kernels (the profiler's kernel durations; launch gaps excluded)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    device = torch.autograd.DeviceType.CUDA
    return sum(e.device_time_total for e in prof.events() if e.device_type == device) / reps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (tokens)")
    parser.add_argument("--num-splits", type=int, default=None, help="force the Triton split-KV factor")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the attention benchmark needs a CUDA GPU")
    from triton.testing import do_bench

    from .triton_paged import TritonPagedAttention

    backends = {"triton": functools.partial(TritonPagedAttention, num_splits=args.num_splits),
                "torch": TorchPagedAttention}
    if importlib.util.find_spec("flashinfer"):
        from .flashinfer_paged import FlashInferPagedAttention

        backends["flashinfer"] = FlashInferPagedAttention
    print("per call: eager us (do_bench) / GPU us (kernels)")
    print(f"{'case':<8} {'B':>3} {'T':>5} {'W':>5} {'prefix':>6}  " + " ".join(f"{n:>17}" for n in backends)
          + f" {'triton GB/s':>11}")
    for name, B, T, W, prefix in CASES:
        view, qkv = make_view(B, T, W, prefix, args.block_size)
        times = []
        for backend in backends.values():
            call = functools.partial(backend(*view).attend, 0, *qkv)
            times.append((do_bench(call, return_mode="median") * 1e3, gpu_us(call)))
        kv_bytes = B * (prefix + W) * HKV * D * 2 * qkv[0].element_size()
        print(f"{name:<8} {B:>3} {T:>5} {W:>5} {prefix:>6}  " + " ".join(f"{e:>8.1f} /{g:>7.1f}" for e, g in times)
              + f" {kv_bytes / times[0][1] / 1e3:>11.0f}")


if __name__ == "__main__":
    main()
