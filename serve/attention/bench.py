"""Attention-kernel benchmark: the Triton backend, and FlashInfer's when installed, against the torch reference on
an architecture's shapes (default Llama-3.1-8B: Hq 32, Hkv 8, D 128; bf16), one layer.

    python -m eyas.serve.attention.bench [--arch llama-3.1-8b] [--block-size 16] [--num-splits N]
    python -m eyas.serve.attention.bench --resources [--warps 4 8]   # no GPU: registers and stack a thread

Times one `attend` call of each backend (the k/v write included; view building and FlashInfer's planning, done
once per forward, excluded) two ways: the eager call with triton.testing.do_bench (median, L2 flushed between
calls), which small cases spend launching kernels from the host; and its GPU time, the profiler's sum of the
call's kernels (what a CUDA graph replays). The Triton kernel's KV-read bandwidth is over its GPU time: the
distinct K and V bytes the view covers, B * (prefix + W) * Hkv * D * 2 * 2, per second (a causal prefill re-reads
its window once per row tile, so there it is a lower bound).

With `--resources` nothing runs: each case's Triton launches (split-KV as on a GPU of `--sms` SMs) are compiled for
sm_90 (`eyas.serve.hopper_compile`) and a thread's registers and stack bytes printed, the attention kernel also at
each of `--warps`. Spilled values (stack) live in local memory; whether that costs is for the GPU to say (none of
the served launches spills: docs/perf.md, thirty-first entry).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from typing import NamedTuple

import torch

from eyas.common.architectures import ARCHITECTURES, architecture_config
from eyas.common.cli import HelpFormatter

from .. import hopper_compile
from ..kv_cache import KVPool
from .torch_sdpa import TorchPagedAttention

DTYPE = torch.bfloat16

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


class Heads(NamedTuple):
    q: int
    kv: int
    dim: int


def heads(arch: str) -> Heads:
    cfg = architecture_config(arch)
    return Heads(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)


def row_blocks(prefix: int, W: int, block_size: int) -> int:
    """The KV blocks a row of `prefix` cached tokens and a window of W takes."""
    return -(-(prefix + W) // block_size)


def make_view(h: Heads, B: int, T: int, W: int, prefix: int, block_size: int):
    """Every row at `prefix` cached tokens, in randomly placed blocks; the window's queries see every earlier
    window key (causal: a chain for verify and draft, which costs the same as a tree)."""
    blocks = row_blocks(prefix, W, block_size)
    pool = KVPool(1, B * blocks, block_size, h.kv, h.dim, DTYPE, "cuda")
    pool.k[0].normal_()
    pool.v[0].normal_()
    block_table = torch.randperm(B * blocks, device="cuda").view(B, blocks).int()
    prefix_lens = torch.full((B,), prefix, dtype=torch.int32, device="cuda")
    window_mask = torch.ones(T, W, dtype=torch.bool, device="cuda").tril(W - T).expand(B, T, W)
    qkv = [torch.randn(B, T, n, h.dim, dtype=DTYPE, device="cuda") for n in (h.q, h.kv, h.kv)]
    return (pool, block_table, prefix_lens, window_mask), qkv


def launch_resources(h: Heads, B: int, T: int, W: int, prefix: int, block_size: int, sms: int, warps: list[int]):
    """[(kernel, constexprs, num_warps, Resources)] of `paged_attention`'s launches on a case, recorded on meta
    tensors with the split-KV of a GPU of `sms` SMs and compiled for sm_90; the attention kernel at its served
    warps, then at each other of `warps`."""
    from . import triton_paged

    meta = torch.device("meta")
    blocks = row_blocks(prefix, W, block_size)
    cache = torch.empty(B * blocks * block_size, h.kv, h.dim, dtype=DTYPE, device=meta)
    splits = triton_paged.launch_config(B, T * (h.q // h.kv), h.kv, blocks * block_size, sms)[2]
    launches = hopper_compile.recorded_launches(lambda: triton_paged.paged_attention(
        torch.empty(B, T, h.q, h.dim, dtype=DTYPE, device=meta), cache, cache,
        torch.empty(B, blocks, dtype=torch.int32, device=meta), torch.empty(B, dtype=torch.int32, device=meta),
        torch.empty(B, T, W, dtype=torch.bool, device=meta), block_size, splits), module=triton_paged)
    found = []
    for launch in sorted(launches):
        served = dict(launch.options).get("num_warps", 4)
        runs = [launch] + [launch._replace(options=tuple((k, w if k == "num_warps" else v) for k, v in launch.options))
                           for w in warps if w != served and launch.kernel == "_paged_attention_kernel"]
        found += [(run.kernel, dict(run.constexprs), dict(run.options).get("num_warps"),
                   hopper_compile.resources(run)) for run in runs]
    return found


def print_resources(args) -> None:
    h = heads(args.arch)
    print(f"a thread's registers and stack bytes compiled for sm_90, {args.arch} (Hq {h.q}, Hkv {h.kv}, D {h.dim}), "
          f"split-KV for {args.sms} SMs; the served launch first")
    print(f"{'case':<8} {'B':>3} {'T':>5} {'W':>5} {'prefix':>6}  {'kernel':<24} {'BLOCK_M':>7} {'BLOCK_N':>7} "
          f"{'warps':>5} {'regs':>5} {'stack':>6}")
    for name, B, T, W, prefix in CASES:
        for kernel, constexprs, warps, used in launch_resources(h, B, T, W, prefix, args.block_size, args.sms,
                                                                args.warps):
            print(f"{name:<8} {B:>3} {T:>5} {W:>5} {prefix:>6}  {kernel:<24} {constexprs.get('BLOCK_M', '-'):>7} "
                  f"{constexprs.get('BLOCK_N', '-'):>7} {warps or '-':>5} {used.registers:>5} {used.stack:>6}")


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
    parser = argparse.ArgumentParser(prog="python -m eyas.serve.attention.bench", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (tokens)")
    parser.add_argument("--num-splits", type=int, default=None, help="force the Triton split-KV factor")
    parser.add_argument("--arch", default="llama-3.1-8b", choices=sorted(ARCHITECTURES), help="the heads' shapes")
    parser.add_argument("--resources", action="store_true",
                        help="compile the Triton launches for sm_90 and print their registers and stack (no GPU)")
    parser.add_argument("--sms", type=int, default=132, help="with --resources: SMs the split-KV is chosen for "
                        "(132: H100, H200)")
    parser.add_argument("--warps", type=int, nargs="+", default=[],
                        help="with --resources: the attention kernel also at these warps a program")
    args = parser.parse_args(argv)
    if args.resources:
        print_resources(args)
        return
    if not torch.cuda.is_available():
        sys.exit("the attention benchmark needs a CUDA GPU (--resources does not)")
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
    h = heads(args.arch)
    for name, B, T, W, prefix in CASES:
        view, qkv = make_view(h, B, T, W, prefix, args.block_size)
        times = []
        for backend in backends.values():
            call = functools.partial(backend(*view).attend, 0, *qkv)
            times.append((do_bench(call, return_mode="median") * 1e3, gpu_us(call)))
        kv_bytes = B * (prefix + W) * h.kv * h.dim * 2 * qkv[0].element_size()
        print(f"{name:<8} {B:>3} {T:>5} {W:>5} {prefix:>6}  " + " ".join(f"{e:>8.1f} /{g:>7.1f}" for e, g in times)
              + f" {kv_bytes / times[0][1] / 1e3:>11.0f}")


if __name__ == "__main__":
    main()
