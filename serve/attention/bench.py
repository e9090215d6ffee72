"""Attention-kernel benchmark: the Triton backend against the torch reference on Llama-3.1-8B shapes
(Hq 32, Hkv 8, D 128, bf16), one layer.

    python -m eyas.serve.attention.bench [--block-size 16] [--num-splits N]

Times one `attend` call of each backend (the k/v write included; the torch backend's host-side view
building excluded) with triton.testing.do_bench (median, L2 flushed between calls), and the Triton
kernel's KV-read bandwidth: the distinct K and V bytes the view covers, B * (prefix + W) * Hkv * D * 2 * 2,
per second (a causal prefill re-reads its window once per row tile, so there it is a lower bound).
"""

from __future__ import annotations

import argparse
import functools
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (tokens)")
    parser.add_argument("--num-splits", type=int, default=None, help="force the Triton split-KV factor")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the attention benchmark needs a CUDA GPU")
    from triton.testing import do_bench

    from .triton_paged import TritonPagedAttention

    print(f"{'case':<8} {'B':>3} {'T':>5} {'W':>5} {'prefix':>6}  {'triton us':>9} {'torch us':>9} "
          f"{'speedup':>7} {'triton GB/s':>11}")
    for name, B, T, W, prefix in CASES:
        view, qkv = make_view(B, T, W, prefix, args.block_size)
        triton_backend = TritonPagedAttention(*view, num_splits=args.num_splits)
        torch_backend = TorchPagedAttention(*view)
        t_triton = do_bench(functools.partial(triton_backend.attend, 0, *qkv), return_mode="median")  # ms
        t_torch = do_bench(functools.partial(torch_backend.attend, 0, *qkv), return_mode="median")
        kv_bytes = B * (prefix + W) * HKV * D * 2 * qkv[0].element_size()
        print(f"{name:<8} {B:>3} {T:>5} {W:>5} {prefix:>6}  {t_triton * 1e3:>9.1f} {t_torch * 1e3:>9.1f} "
              f"{t_torch / t_triton:>6.2f}x {kv_bytes / t_triton / 1e6:>11.0f}")


if __name__ == "__main__":
    main()
