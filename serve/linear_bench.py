"""Few-rows linear benchmark: `rows_kernel` at its served launch and at a grid of others against cuBLAS, µs a call,
on the weight shapes of an architecture's target (random weights), at verification's and a draft pass's row counts,
or with `--head` on an EAGLE-3 draft head's for that target (a draft pass's linears, and its fc).

    python -m eyas.serve.linear_bench --arch llama-3.1-8b --rows 8 --weights qkv gate_up --splits 1 2 4
    python -m eyas.serve.linear_bench --arch llama-3.1-8b --head --draft-vocab 8192 --fp8 --rows 8 \
        --weights qkv o gate_up down lm_head fc --block-n 16 32 64 --block-k 256 512 --stages 1 2 3 --splits 1 4

Each call runs inside a CUDA graph over distinct copies of its weight, at least 256 MB of them in all, so no call
reads its weight from L2 (50 MB on an H200); µs a call is the median replay's time over the copies. The kernel runs as
served (`kernels.launch_options`): under programmatic dependent launch but for long calls that share SMs, so a call
may start loading while the one before finishes, as it does between the served model's kernels; cuBLAS cannot.
A head's calls run released late (`kernels.releasing_late`), as the engine runs a speculative step's passes.
cuBLAS is `F.linear`, and `silu_mul` after the joint gate/up (the served path's two launches there). With `--fp8`
the kernel reads float8 copies (`serve/fp8.py`), as a draft head's with `--draft-fp8`, and cuBLAS the bf16 weight.

A table row per weight and row count: cuBLAS, the one-token kernel at one row of the same weight (what a row more
costs), the served launch (`rows_launch`), the grid's fastest and its launch
(BLOCK_N, BLOCK_K, stages, warps, splits; splits as launched: equal runs of whole chunks of K, and none over more
tiles than the kernel has counters for); `--all` prints every launch of the grid. A launch whose stages of tiles need
more shared memory than an SM has is listed, untimed, under its row. Per-call times can mislead (in docs/perf.md,
launches within 1 µs of cuBLAS a call made verification 0.6–1 ms slower in place under programmatic dependent
launch, and 0.1 ms faster without it), so a launch that wins here is then measured in `bench-eagle`'s steps.

With `--resources` nothing runs and no GPU is needed: each launch is compiled for sm_90 (`hopper_compile`) and the
table gives a thread's registers, the bytes of stack its spilled values take and a program's KB of shared memory
(which bound how many programs share an SM), served launch first: the kernel
the GPU's launcher would build (aligned pointers and sizes divisible by 16 marked so), by this machine's Triton.

    python -m eyas.serve.linear_bench --arch smollm2-135m --rows 64 --block-k 64 128 --warps 4 8 --resources
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from eyas.common.architectures import ARCHITECTURES, architecture_config
from eyas.common.cli import HelpFormatter
from eyas.common.eagle3 import Eagle3Head
from eyas.common.layers import fuse_projections

from . import hopper_compile, kernels
from .bench import add_draft_vocab_argument, random_head_config
from .commands import require_output_dirs, require_positive
from .cuda_graphs import replay_ms
from .fp8 import E4M3, Fp8Weight, Fp8Weights, quantize

L2_DEFEAT_BYTES = 256 << 20


def weight_shapes(arch: str) -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, SiLU·mul output) of the target's linear layers as the engine serves them (q/k/v and gate/up
    joined, `fuse_projections`)."""
    cfg = architecture_config(arch)
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    return {
        "qkv": (heads + 2 * cfg.num_key_value_heads * cfg.head_dim, hidden, False),
        "o": (hidden, heads, False),
        "gate_up": (2 * cfg.intermediate_size, hidden, True),
        "down": (hidden, cfg.intermediate_size, False),
        "lm_head": (cfg.vocab_size, hidden, False),
    }


def head_weight_shapes(arch: str, draft_vocab: int | None = None) -> dict[str, tuple[int, int, bool]]:
    """The same of bench-eagle's random EAGLE-3 head for `arch`'s target (`random_head_config`: `draft_vocab` draft
    tokens), as the engine serves it: its layer's (q/k/v over the token's embedding and the stream side by side), its
    lm_head, and fc (over the target's captured streams)."""
    with torch.device("meta"):
        head = Eagle3Head(random_head_config(architecture_config(arch), draft_vocab))
    fuse_projections(head)
    attention, mlp = head.midlayer.self_attn, head.midlayer.mlp
    linears = {"qkv": attention.qkv_proj, "o": attention.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj,
               "lm_head": head.lm_head, "fc": head.fc}
    return {name: (*linear.weight.shape, name == "gate_up") for name, linear in linears.items()}


def us_per_call(call, copies: int) -> float:
    """µs a call of `call(i)`, i < copies, each copy once in a CUDA graph."""
    return replay_ms(lambda: [call(i) for i in range(copies)]) * 1e3 / copies


def measure(N: int, K: int, silu: bool, rows: int, launches: list[kernels.RowsLaunch], fp8: bool,
            device: str) -> dict:
    """A weight [N, K] at `rows`: µs a call of cuBLAS, of the one-token kernel at one row, of the served launch and of
    each of `launches` as the kernel runs them (`as_launched`)."""
    copies = max(2, -(-L2_DEFEAT_BYTES // (N * K * 2)))
    weights = [torch.randn(N, K, device=device, dtype=torch.bfloat16) * K**-0.5 for _ in range(copies)]
    quantized = [quantize(w) for w in weights] if fp8 else [None] * copies
    tables = [Fp8Weights() for _ in range(copies)]  # the one-token kernel's: each weight's copy where fp8
    for table, weight, copy in zip(tables, weights, quantized, strict=True):
        if copy is not None:
            table.add(weight, copy)
    x = torch.randn(rows, K, device=device, dtype=torch.bfloat16)
    x_one = x[:1].contiguous()

    def cublas(i):
        y = F.linear(x, weights[i])
        return kernels.silu_mul(*y.chunk(2, dim=-1)) if silu else y

    def kernel(launch):
        return lambda i: kernels.rows_kernel(x, weights[i], None, silu, quantized[i], launch)

    def one_row(i):
        return kernels.fused_linear(x_one, weights[i], silu_mul_output=silu, fp8=tables[i])

    def timed(launch):
        try:
            return us_per_call(kernel(launch), copies)
        except OutOfResources:  # its stages of tiles need more shared memory than an SM has: not a launch to run
            return None

    N_out = N // 2 if silu else N
    served = kernels.rows_launch(rows, N_out, K, fp8, silu, kernels.gpu(torch.device(device)))
    return dict(N=N, K=K, silu=silu, rows=rows, fp8=fp8, cublas_us=us_per_call(cublas, copies),
                one_row_us=us_per_call(one_row, copies), served_us=us_per_call(kernel(None), copies),
                served_launch=served,
                grid=[(run, timed(run)) for run in as_launched(launches, N_out, K)])


def meta_operands(N: int, K: int, rows: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor, Fp8Weight | None]:
    """x [rows, K] and a weight [N, K] in bf16, and the weight's float8 copy where `fp8`, on the meta device: shapes
    alone, for recording the launches a linear makes (`hopper_compile.recorded_launches`)."""
    meta = torch.device("meta")
    x, weight = (torch.empty(*shape, dtype=torch.bfloat16, device=meta) for shape in ((rows, K), (N, K)))
    copy = Fp8Weight(torch.empty(N, K, dtype=E4M3, device=meta), torch.empty(N, device=meta)) if fp8 else None
    return x, weight, copy


def launch_resources(N: int, K: int, silu: bool, rows: int, launches: list[kernels.RowsLaunch], fp8: bool
                     ) -> list[tuple[kernels.RowsLaunch, hopper_compile.Resources]]:
    """A thread's registers and stack, and a program's shared memory, in each of `launches` of `rows_kernel` at a
    weight [N, K] and `rows` rows, compiled for sm_90 (the launches recorded on meta tensors)."""
    x, weight, copy = meta_operands(N, K, rows, fp8)
    found = []
    for launch in launches:
        (spec,) = hopper_compile.recorded_launches(lambda launch=launch: kernels.rows_kernel(x, weight, None, silu,
                                                                                               copy, launch))
        found.append((launch, hopper_compile.resources(spec)))
    return found


def as_launched(launches: list[kernels.RowsLaunch], N_out: int, K: int) -> list[kernels.RowsLaunch]:
    """The distinct launches `rows_kernel` runs for `launches` (splits as equal runs of whole chunks of K), less
    those that split more tiles than it has arrival counters for."""
    runs = []
    for launch in launches:
        run = kernels.as_run(launch, K)
        if run not in runs and (run.splits == 1 or -(-N_out // run.block_n) <= kernels.SPLIT_MAX_TILES):
            runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eyas.serve.linear_bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--arch", default="llama-3.1-8b", choices=sorted(ARCHITECTURES), help="whose linear shapes")
    parser.add_argument("--head", action="store_true",
                        help="an EAGLE-3 head's linears for that target (a draft pass's), released late as served")
    add_draft_vocab_argument(parser)
    parser.add_argument("--weights", nargs="+", default=["qkv", "o", "gate_up", "down"],
                        choices=["qkv", "o", "gate_up", "down", "lm_head", "fc"],
                        help="which of its linears (fc: a head's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16],
                        help=f"rows a call (2 to {kernels.ROWS_MAX}): a tree's or a chain's verification, a draft pass")
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64], help="the grid: weight rows a program")
    parser.add_argument("--block-k", type=int, nargs="+", default=[128, 256], help="the grid: K a loop iteration")
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4], help="the grid: pipeline stages")
    parser.add_argument("--warps", type=int, nargs="+", default=[4], help="the grid: warps a program")
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2], help="the grid: programs sharing a K range")
    parser.add_argument("--fp8", action="store_true", help="the kernel reads float8 copies of the weights")
    parser.add_argument("--all", action="store_true", help="print every launch of the grid")
    parser.add_argument("--resources", action="store_true",
                        help="compile each launch for sm_90 and print its registers and stack a thread instead of "
                        "timing it (no GPU needed)")
    parser.add_argument("--json", type=Path, help="write every timing to this JSON: a record per weight and row count "
                        "(name, N, K, silu, rows, fp8, cublas_us, one_row_us, served_us, served_launch, grid "
                        "[[launch, us]]; us null where the launch needs more shared memory than an SM has)")
    args = parser.parse_args(argv)
    if bad := [r for r in args.rows if not 2 <= r <= kernels.ROWS_MAX]:
        parser.error(f"--rows {bad}: the few-rows kernel takes 2 to {kernels.ROWS_MAX} rows")
    require_output_dirs(parser, args, "json")
    require_positive(parser, args, "draft_vocab")
    if "fc" in args.weights and not args.head:
        parser.error("--weights fc: a target has no fc; it is a head's (--head)")
    if args.draft_vocab is not None and not args.head:
        parser.error("--draft-vocab is a head's (--head)")
    launches = [kernels.RowsLaunch(*c) for c in itertools.product(args.block_n, args.block_k, args.stages,
                                                                    args.warps, args.splits)]
    shapes = head_weight_shapes(args.arch, args.draft_vocab) if args.head else weight_shapes(args.arch)
    if args.resources:
        print_resources(args, shapes, launches)
        return
    if not torch.cuda.is_available():
        sys.exit("the linear benchmark needs a CUDA GPU (--resources does not)")
    print(f"µs a call, {weights_named(args)}; launch = (BLOCK_N, BLOCK_K, stages, warps, splits)")
    print(f"{'weight':<8} {'N x K':>13} {'rows':>4} {'cuBLAS':>8} {'1 row':>8} {'served':>8} {'best':>8}  best launch")
    records = []
    for name in args.weights:
        N, K, silu = shapes[name]
        for rows in args.rows:
            with kernels.releasing_late(args.head):
                record = {"name": name, **measure(N, K, silu, rows, launches, args.fp8, "cuda")}
            records.append(record)
            ran = [(launch, us) for launch, us in record["grid"] if us is not None]
            best_launch, best = min(ran, key=lambda r: r[1]) if ran else ("none of the grid fits", float("nan"))
            print(f"{name:<8} {f'{N}x{K}':>13} {rows:>4} {record['cublas_us']:>8.2f} {record['one_row_us']:>8.2f} "
                  f"{record['served_us']:>8.2f} {best:>8.2f}  {tuple(best_launch) if ran else best_launch}")
            for launch, us in record["grid"] if args.all else [r for r in record["grid"] if r[1] is None]:
                timing = f"{us:>8.2f}" if us is not None else f"{'-':>8}"
                print(f"{'':<8} {'':>13} {'':>4} {'':>8} {'':>8} {'':>8} {timing}  {tuple(launch)}"
                      + ("  needs more shared memory than an SM has" if us is None else ""))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


def weights_named(args) -> str:
    """Whose weights the tables hold, and in which dtype."""
    whose = f"{args.arch}'s EAGLE-3 head" if args.head else args.arch
    return f"{whose}, {'float8' if args.fp8 else 'bf16'} weights"


def print_resources(args, shapes: dict, launches: list[kernels.RowsLaunch]) -> None:
    """--resources: a row per weight, row count and launch (the served one first, marked *)."""
    print(f"a thread's registers and stack bytes, a program's KB of shared memory, {weights_named(args)}, compiled "
          "for sm_90; launch = (BLOCK_N, BLOCK_K, stages, warps, splits)")
    print(f"{'weight':<8} {'N x K':>13} {'rows':>4} {'regs':>5} {'stack':>6} {'smem':>5}  launch")
    for name in args.weights:
        N, K, silu = shapes[name]
        N_out = N // 2 if silu else N
        for rows in args.rows:
            served = kernels.rows_launch(rows, N_out, K, args.fp8, silu)
            grid = [served] + [run for run in as_launched(launches, N_out, K) if run != served]
            for launch, used in launch_resources(N, K, silu, rows, grid, args.fp8):
                mark = "*" if launch == served else " "
                print(f"{name:<8} {f'{N}x{K}':>13} {rows:>4} {used.registers:>5} {used.stack:>6} "
                      f"{used.shared / 1024:>5.0f} {mark}{tuple(launch)}")


if __name__ == "__main__":
    main()
