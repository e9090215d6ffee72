"""Fused Triton kernels for the model's layers at inference: RMSNorm (and two side by side, the EAGLE-3 layer's input),
rotary on q and k (with the paged cache's store of k and v in the same launch, `rotary_store`, which the Triton
backend calls), SiLU·mul, a one-token linear layer with the RMSNorm before it and SiLU·mul and the residual stream's
add after it fused in, and a few-rows matmul (verification's and a draft pass's rows: small weights, and large ones
in long or whole-SM calls) with a folded norm, SiLU·mul and the add in its epilogue and K split over programs where
its output columns are few (`rows_matmul`), both reading a draft head's float8 copies where the engine made them
(`--draft-fp8`, `fp8.py`); and how every Triton kernel of the engine launches (`launch_options`, `follow`). A decode
step's kernels around the layers (the draft tree's, verification's, the accept phase's) are `step_kernels.py`'s.

Each replaces a chain of small torch kernels with one launch (RMSNorm alone is eight: cast, pow, mean, add,
rsqrt, mul, cast, mul by the weight), which is what a batch-1 decode step spends much of its time on. Each
reproduces the torch reference in `eyas.common.layers` rounding for rounding: arithmetic runs in fp32 (as
torch's CUDA kernels compute half types in fp32), and every intermediate the reference materialises in a half
dtype is rounded to that dtype here too. Results equal the reference up to fp32 reduction order and the fast
rsqrt/exp; one exception: where a norm is folded into a linear layer's weight (the one-token linear, the few-rows
kernel's `NORM`, SiLU·mul's `rms_of`), its 1 / RMS scales the product instead of x (see `_fused_linear_kernel`).

The model stays defined once (`eyas.common`): its layers call their `kernels` (`common.layers.Kernels`, torch by
default), and the engine installs `FUSED` on the models it serves on CUDA when triton is installed, whatever the
attention backend (`install`). They have no backward: the trainer keeps the torch kernels. Launches read sizes
from tensor shapes only and never sync the host, so CUDA graphs capture them. Triton launches on the current CUDA
device; on Hopper and later, with programmatic dependent launch (`launch_options`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor, nn
from torch.nn import functional as F

from eyas.common.layers import Kernels, use_kernels

from .fp8 import Fp8Weight, Fp8Weights

jit = triton.jit
# Whether Triton's CPU interpreter runs the kernels (their Python alone: no inline PTX), as Triton decides when it
# defines them, at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
COMPILED = tl.constexpr(not INTERPRETED)


def install(model: nn.Module, kernels: Kernels | None = None) -> None:
    """Makes every layer of `model` use `kernels` (default: the fused ones, inference only: no backward)."""
    use_kernels(model, kernels or FUSED)
    first = next(model.parameters(), None)
    if first is not None:  # the split matmuls' counters, made here rather than inside a CUDA graph's capture
        _split_counters(first.device)


EARLY = tl.constexpr(1)  # `follow` lets the next kernel launch once this kernel's programs are resident
LATE = tl.constexpr(2)  # ... only as they end (`releasing_late`)
_releasing_late = False


@contextlib.contextmanager
def releasing_late(on: bool = True):
    """Kernels launched within it (or captured, a CUDA graph's) let the next kernel launch only as their programs end,
    not at once, and long calls that share SMs (`long_call`, float8 copies) launch under programmatic dependent launch
    too. Where a kernel is launched as the one before ends and lets the next launch at once, a streaming matmul after
    it (72 KB of shared memory a program) had its programs packed three to an SM on a third of the SMs; launched
    late, they spread (docs/perf.md, thirty-seventh entry). The engine releases late in a speculative step's passes on
    a target whose matmuls stream tens of µs a call (`Engine`): with every kernel released late an 8B target's (5, 4,
    8) step took 5.33 against 5.48 ms, but its plain step 4.10 against 4.02, and SmolLM2's (8, 8, 64) step 1.47
    against 1.39 (its kernels take a few µs, and early launches hide the gaps between them; docs/perf.md,
    thirty-seventh and thirty-eighth entries). Long calls that hold a whole SM (`whole_sm_call`) let the next kernel
    launch at once even here."""
    global _releasing_late
    before, _releasing_late = _releasing_late, on
    try:
        yield
    finally:
        _releasing_late = before


@functools.cache
def _launches_dependents(device: torch.device) -> bool:
    """Whether kernels launch under programmatic dependent launch on `device`: Hopper and later, with a Triton that
    has `gdc_wait` (not the CPU interpreter)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and hasattr(tl.extra.cuda, "gdc_wait"))


class Placement(enum.Enum):
    """How a kernel's programs sit on the SMs, which decides its launch (`launch_options`)."""

    SHORT = enum.auto()  # a few µs, several programs an SM: every kernel but `rows_kernel`'s long calls
    SHARES_SM = enum.auto()  # a long call whose programs share SMs (`long_call`: float8 copies, a launch given)
    WHOLE_SM = enum.auto()  # a long call of one program an SM (`whole_sm_call`)


def launch_options(device: torch.device, placement: Placement = Placement.SHORT) -> dict:
    """What every kernel here (and the Triton attention's) launches with: on Hopper and later, programmatic
    dependent launch. A kernel then starts while the one before it in the stream is finishing, and waits for it
    in `follow`, so the gap between two kernels of a CUDA graph (about 2.5 µs on an H200, docs/perf.md) overlaps
    the first one's last programs. Off elsewhere (older GPUs, the CPU interpreter, a Triton without `gdc_wait`), and
    for a long call that shares SMs (SHARES_SM) but where kernels release late (`releasing_late`). A WHOLE_SM call
    lets the next launch at once even there: a whole-SM call after it cannot put two programs on an SM, so each
    starts as the one before leaves its SM."""
    if not _launches_dependents(device) or (placement is Placement.SHARES_SM and not _releasing_late):
        return {"PDL": 0}
    early = placement is Placement.WHOLE_SM or not _releasing_late
    return {"PDL": EARLY.value if early else LATE.value, "launch_pdl": True}


@jit
def follow(PDL: tl.constexpr):
    """Every kernel calls it before it writes, and before it reads what the kernel just before may write. Under PDL
    (EARLY or LATE, `launch_options`): wait until the kernel before has finished and its writes are visible (its
    outputs are inputs here, and memory written here may be memory it still reads); EARLY then lets the next kernel
    launch (its programs take SM slots once all of these are resident), LATE leaves it to launch as these programs
    end. Either way a kernel starts only once every program of the one before has waited here, so before its own
    wait it may read what was written two or more launches back (weights, which no kernel writes, and a forward's
    inputs, written before the layers), never its predecessor's outputs."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if PDL == EARLY:
            tl.extra.cuda.gdc_launch_dependents()


def as_rows(x: Tensor) -> Tensor:
    """x [..., N] -> [rows, N] with unit stride along N (a view where possible)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(1) == 1 else x.contiguous()


def _row_warps(block: int) -> int:
    """Warps of a program that norms one row of `block` entries: one per 512 of them, 1 to 16."""
    return min(max(block // 512, 1), 16)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm.forward over the last dim, one program per row: x [..., N], weight [N] (None: a unit weight, one
    folded into the next projection) -> norm(x), a new contiguous tensor in the reference's dtype (weight's and
    x's promoted)."""
    n = x.shape[-1]
    rows = as_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype if weight is None else torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, x if weight is None else weight.contiguous(), out, rows.stride(0), n, eps, HAS_WEIGHT=weight is not None,
        BLOCK=block, num_warps=_row_warps(block), **launch_options(x.device),
    )
    return out


@jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, N, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    follow(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    _norm_row(x, w_ptr, out_ptr + row * N, N, eps, cols, ok, HAS_WEIGHT)


@jit
def _norm_row(x, w_ptr, out_ptr, N, eps, cols, ok, HAS_WEIGHT: tl.constexpr):
    """RMSNorm of one row x [BLOCK] (its N first entries) into out_ptr [N]; without HAS_WEIGHT a unit weight."""
    x32 = x.to(tl.float32)
    normed = (x32 * _rstd(x32, N, eps)).to(x.dtype)  # the reference casts back to the input dtype before the weight
    if HAS_WEIGHT:
        normed = normed.to(tl.float32) * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, normed.to(out_ptr.dtype.element_ty), mask=ok)


@jit
def _rstd(x32, N, eps):
    """1 / RMS of a row x32 [BLOCK] fp32 whose first N entries are its values (the rest zeros)."""
    return tl.rsqrt(tl.sum(x32 * x32, 0) / N + eps)


def norm_cat(a: Tensor, b: Tensor, norm_a: tuple[Tensor, float], norm_b: tuple[Tensor, float]) -> Tensor:
    """`eyas.common.layers.norm_cat` in one launch (torch takes the two norms' kernels and the cat): a, b [..., N]
    -> [..., 2N] new contiguous, one program per (row, half)."""
    assert a.shape == b.shape, f"norm_cat of {tuple(a.shape)} and {tuple(b.shape)}"
    (w_a, eps_a), (w_b, eps_b) = norm_a, norm_b
    dtype = torch.promote_types(w_a.dtype, a.dtype)
    assert dtype == torch.promote_types(w_b.dtype, b.dtype), "both halves must normalise to one dtype"
    n = a.shape[-1]
    rows_a, rows_b = as_rows(a), as_rows(b)
    out = torch.empty(*a.shape[:-1], 2 * n, dtype=dtype, device=a.device)
    block = triton.next_power_of_2(n)
    _norm_cat_kernel[(rows_a.shape[0], 2)](rows_a, rows_b, w_a.contiguous(), w_b.contiguous(), out,
                                           rows_a.stride(0), rows_b.stride(0), n, eps_a, eps_b, BLOCK=block,
                                           num_warps=_row_warps(block), **launch_options(a.device))
    return out


@jit
def _norm_cat_kernel(a_ptr, b_ptr, w_a_ptr, w_b_ptr, out_ptr, stride_a, stride_b, N, eps_a, eps_b,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    out = out_ptr + row * 2 * N
    if tl.program_id(1) == 0:
        a = tl.load(a_ptr + row * stride_a + cols, mask=ok, other=0.0)
        _norm_row(a, w_a_ptr, out, N, eps_a, cols, ok, True)
    else:
        b = tl.load(b_ptr + row * stride_b + cols, mask=ok, other=0.0)
        _norm_row(b, w_b_ptr, out + N, N, eps_b, cols, ok, True)


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """apply_rotary on q [B, T, Hq, D] and k [B, T, Hkv, D] in one launch; cos, sin [B or 1, T, D].

    One program per token rotates all its q and k heads. -> new contiguous (q, k) in the reference's dtypes.
    """
    return _rotary_launch(q, k, cos, sin)


def rotary_store(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, k_cache: Tensor,
                 v_cache: Tensor) -> Tensor:
    """`rotary` and the paged cache's store in one launch: rotated q -> a new contiguous [B, T, Hq, D]; rotated k
    and v go straight to k_cache[slots] and v_cache[slots] (caches [num_slots, Hkv, D] contiguous, slots [B, T])."""
    B, T, Hkv, D = k.shape
    assert v.shape == k.shape and slots.shape == (B, T) and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype == torch.promote_types(k.dtype, cos.dtype) and v_cache.dtype == v.dtype
    v = v if v.stride(3) == 1 and v.stride(2) == D else v.contiguous()
    q_out, _ = _rotary_launch(q, k, cos, sin, (v, slots.contiguous(), k_cache, v_cache))
    return q_out


def _rotary_launch(q, k, cos, sin, store=None):
    """store: (v, slots, k_cache, v_cache), or None for a new contiguous k."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    assert k.shape == (B, T, Hkv, D) and D % 2 == 0 and cos.dtype == sin.dtype
    q, k = (x if x.stride(3) == 1 else x.contiguous() for x in (q, k))
    cos, sin = (x.expand(B, T, D) for x in (cos, sin))
    cos, sin = (x if x.stride(2) == 1 else x.contiguous() for x in (cos, sin))
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
    if store is None:
        k_out = torch.empty(k.shape, dtype=torch.promote_types(k.dtype, cos.dtype), device=k.device)
        v, slots, v_cache = k, q_out, k_out  # placeholders, never read or written
    else:
        v, slots, k_out, v_cache = store
    _rotary_kernel[(B * T,)](
        q, k, v, cos, sin, slots, q_out, k_out, v_cache, T, *q.stride()[:3], *k.stride()[:3], *v.stride()[:2],
        *cos.stride()[:2], *sin.stride()[:2], slots.stride(0), Hq, Hkv, STORE=store is not None, HALF=D // 2,
        BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HKV=triton.next_power_of_2(Hkv),
        BLOCK_HALF=triton.next_power_of_2(D // 2), BLOCK_ROW=triton.next_power_of_2(Hkv * D),
        **launch_options(q.device),
    )
    return q_out, k_out


@jit
def _rotary_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr, k_out_ptr, v_cache_ptr, T,
                   stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                   stride_cb, stride_ct, stride_sb, stride_st, stride_slots, HQ, HKV, STORE: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_ROW: tl.constexpr, PDL: tl.constexpr):
    """One token. k's rotated heads go to row `token` of k_out, or with STORE to row slots[b, t] of the cache (the
    same [Hkv, D] layout), and v's row to that row of v_cache."""
    token = tl.program_id(0).to(tl.int64)
    b, t = token // T, token % T
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    # Before the wait (`follow`: written before the q/k/v projection this kernel follows): the two halves of cos and
    # sin [BLOCK_HALF] (equal for Rotary's tables, but the reference reads both) and the token's slot.
    c = cos_ptr + b * stride_cb + t * stride_ct + d
    s = sin_ptr + b * stride_sb + t * stride_st + d
    c1, c2 = tl.load(c, mask=d_ok).to(tl.float32), tl.load(c + HALF, mask=d_ok).to(tl.float32)
    s1, s2 = tl.load(s, mask=d_ok).to(tl.float32), tl.load(s + HALF, mask=d_ok).to(tl.float32)
    row = token
    if STORE:
        row = tl.load(slots_ptr + b * stride_slots + t).to(tl.int64)
    follow(PDL)
    _rotate_heads(q_ptr + b * stride_qb + t * stride_qt, stride_qh, q_out_ptr + token * HQ * 2 * HALF, HQ,
                  c1, c2, s1, s2, d, d_ok, HALF, BLOCK_HQ)
    if STORE:
        i = tl.arange(0, BLOCK_ROW)
        ok = i < HKV * 2 * HALF
        v = tl.load(v_ptr + b * stride_vb + t * stride_vt + i, mask=ok)
        tl.store(v_cache_ptr + row * HKV * 2 * HALF + i, v, mask=ok)
    _rotate_heads(k_ptr + b * stride_kb + t * stride_kt, stride_kh, k_out_ptr + row * HKV * 2 * HALF, HKV,
                  c1, c2, s1, s2, d, d_ok, HALF, BLOCK_HKV)


@jit
def _rotate_heads(x_ptr, stride_h, out_ptr, H, c1, c2, s1, s2, d, d_ok, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """One token's H heads: out = x * cos + cat(-x2, x1) * sin, the two products and the sum each rounded to
    the output dtype as torch does (x [BLOCK_H, BLOCK_HALF] per half; out rows contiguous)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    ok = (h < H) & d_ok[None, :]
    x = x_ptr + h * stride_h + d[None, :]
    x1 = tl.load(x, mask=ok).to(tl.float32)
    x2 = tl.load(x + HALF, mask=ok).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    out1 = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)
    out2 = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
    out = out_ptr + h * (2 * HALF) + d[None, :]
    tl.store(out, out1.to(ty), mask=ok)
    tl.store(out + HALF, out2.to(ty), mask=ok)


def silu_mul(gate: Tensor, up: Tensor, *, rms_of: Tensor | None = None, eps: float = 0.0) -> Tensor:
    """F.silu(gate) * up for two tensors of one shape [..., N] -> a new contiguous tensor in the reference's dtype.
    Rows may be strided (the two halves of a joint gate/up projection's output are read in place). With `rms_of`
    [..., K], the rows gate and up were projected from by a weight with an RMSNorm folded in (`fold_norm`): gate and
    up are first scaled by their row's 1 / RMS (eps added), and rounded as the projection of the normed row is."""
    assert gate.shape == up.shape
    gate_rows, up_rows = as_rows(gate), as_rows(up)  # [rows, N] each
    rows, n = gate_rows.shape
    stream = gate_rows if rms_of is None else as_rows(rms_of)  # [rows, K]
    assert stream.shape[0] == rows, f"{stream.shape[0]} rows to normalise {rows}"
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    _silu_mul_kernel[(rows, triton.cdiv(n, 1024))](
        gate_rows, up_rows, stream, out, n, gate_rows.stride(0), up_rows.stride(0), stream.stride(0), stream.shape[1],
        eps, SCALED=rms_of is not None, BLOCK=1024,
        BLOCK_K=triton.next_power_of_2(stream.shape[1]) if rms_of is not None else 16,  # unscaled: unused
        **launch_options(gate.device),
    )
    return out


@jit
def _silu_mul_kernel(gate_ptr, up_ptr, stream_ptr, out_ptr, n, stride_gate, stride_up, stride_stream, K, eps,
                     SCALED: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    dtype = gate_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_gate + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + i, mask=ok, other=0.0).to(tl.float32)
    if SCALED:
        k = tl.arange(0, BLOCK_K)
        rstd = _rstd(tl.load(stream_ptr + row * stride_stream + k, mask=k < K, other=0.0).to(tl.float32), K, eps)
        g = (g * rstd).to(dtype).to(tl.float32)
        up = (up * rstd).to(up_ptr.dtype.element_ty).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)  # F.silu rounds to gate's dtype
    tl.store(out_ptr + row * n + i, (silu.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=ok)


def fused_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                 norm: tuple[Tensor | None, float] | None = None, silu_mul_output: bool = False,
                 residual: Tensor | None = None, donate_residual: bool = False, fp8: Fp8Weights | None = None
                 ) -> Tensor:
    """`eyas.common.layers.fused_linear`: residual + epilogue(linear(norm(x))), the RMSNorm with `norm` = (weight or
    None, eps), the epilogue SiLU·mul of the output's two halves with `silu_mul_output`, the residual stream added
    with `residual` (by cuBLAS's matmul into it, where the caller donates it). Where `fp8` holds a float8 copy of
    `weight` (`serve/fp8.py`), the one-token and few-rows kernels read that copy. x [..., K], weight [N, K] -> y
    [..., N] ([..., N / 2] with silu_mul_output)."""
    assert not silu_mul_output or weight.shape[0] % 2 == 0, f"a joint gate/up weight of {weight.shape[0]} rows"
    quantized = fp8.get(weight) if fp8 is not None else None
    if (x.numel() != x.shape[-1] or x.dtype != weight.dtype or not weight.is_contiguous()
            or (residual is not None and residual.dtype != x.dtype)):
        return rows_matmul(x, weight, bias, norm=norm, silu_mul_output=silu_mul_output, residual=residual,
                           donate_residual=donate_residual, quantized=quantized)
    x = x.contiguous()
    N, K = weight.shape
    assert x.shape[-1] == K, f"input of {x.shape[-1]} features for a [{N}, {K}] weight"
    N_out = N // 2 if silu_mul_output else N
    out = torch.empty(*x.shape[:-1], N_out, dtype=x.dtype, device=x.device)
    assert residual is None or residual.shape == out.shape, f"residual {tuple(residual.shape)} for {tuple(out.shape)}"
    block_n, block_k, num_warps = launch_config(N, K, float8=quantized is not None)
    block_n //= 2 if silu_mul_output else 1  # a program's outputs: it reads a gate row and an up row for each
    norm_weight = norm[0] if norm is not None else None
    _fused_linear_kernel[(triton.cdiv(N_out, block_n),)](
        x, residual.contiguous() if residual is not None else x, *_weight_and_scale(weight, quantized),
        bias if bias is not None else weight, norm_weight if norm_weight is not None else weight, out,
        N_out, K, norm[1] if norm else 0.0,
        HAS_RESIDUAL=residual is not None, HAS_NORM=norm is not None, NORM_WEIGHT=norm_weight is not None,
        HAS_BIAS=bias is not None, HAS_SCALE=quantized is not None, SILU_MUL=silu_mul_output, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, **launch_options(x.device),
    )
    return out


def _weight_and_scale(weight: Tensor, quantized: Fp8Weight | None) -> tuple[Tensor, Tensor]:
    """What the linear kernels read: the float8 copy and its scales, or the weight (and the weight again as an unused
    scale pointer)."""
    return (quantized.values, quantized.scale) if quantized is not None else (weight, weight)


def with_fp8(table: Fp8Weights) -> Kernels:
    """`FUSED`, its linear layers reading the float8 copies in `table` (`serve/fp8.py`): what the engine installs on a
    draft head served with `--draft-fp8`."""
    return dataclasses.replace(FUSED, linear=functools.partial(fused_linear, fp8=table))


ROWS_MAX = 64  # more rows: cuBLAS. Also the widest tile of rows (`rows_tile`, `early_first_chunk`, SQUARES_BY_DOT)
ROWS_FEW = 16  # up to this many rows the kernel reads float8 copies of large weights, and makes long calls; past it
# small weights take narrow tiles (`rows_launch`)
ROWS_LARGE_WEIGHT = 1 << 24  # entries from which a weight is large: every weight of an 8B head; of SmolLM2's, its
# lm_head alone (K = 576: never a long call)
# bf16/fp16 weights of up to ROWS_MAX_WEIGHT entries go to the kernel, and those of up to ROWS_LONG_MAX_WEIGHT in its
# long calls, a joint gate/up weight counting as one of its halves (an 8B target's q/k/v, gate/up and down at
# verification: the folded norm, SiLU·mul and the residual add in the call, no split-K reduce; the 8B (5, 4, 8) step
# 5.61 against 5.73-5.75 ms with q/k/v and down, 5.49 against 5.54 with gate/up too), and at 17 to 64 rows where
# their programs hold whole SMs (`whole_sm_call`; launched without PDL and sharing SMs, q/k/v and down at 48 rows had
# made the (6, 8, 48) step slower, 6.93 against 6.30 ms). Larger weights go to cuBLAS, and SmolLM2's lm_head (K = 576)
# is faster there (docs/perf.md, sixteenth, thirty-sixth, thirty-seventh and forty-sixth entries).
ROWS_MAX_WEIGHT = 1 << 24
ROWS_LONG_MAX_WEIGHT = 1 << 26
ROWS_LONG_MIN_K = 4096  # a long call's inputs, at least


class Gpu(NamedTuple):
    """What `rows_launch` fits its launches to: the GPU's SMs, and the shared memory (bytes) one program may ask."""

    sms: int
    shared: int


HOPPER = Gpu(132, 227 << 10)  # an H100's or H200's: the launches off CUDA (the interpreter, launches on meta tensors)
WHOLE_SM_SHARED = 193 << 10  # what a program may ask where `rows_launch` gives whole-SM launches (the largest: 192 KB)
# `rows_launch`'s whole-SM launches by the tile of rows (BLOCK_M) they run in: (BLOCK_N, BLOCK_K, stages) on a plain
# weight whose tiles of 32 columns fit one wave of the SMs, on one whose do not, and through SiLU·mul; each the fastest
# of its shapes in sweeps at 8, 32 and 48 rows on an H100, and 120-192 KB of shared memory a program, compiled for sm_90
# (docs/perf.md, forty-fifth and forty-sixth entries); at 33-64 rows 6 stages on an 8B target's o and down, not 5 (the
# (6, 8, 48) step 7.63-7.64 against 7.71 ms, interleaved on an H100: forty-ninth entry).
WHOLE_SM_LAUNCHES = {16: ((32, 256, 6), (64, 256, 4), (64, 128, 5)),
                     32: ((32, 256, 5), (64, 256, 4), (64, 128, 4)),
                     64: ((32, 128, 6), (64, 64, 9), (64, 128, 3))}


@functools.cache
def gpu(device: torch.device) -> Gpu:
    """A CUDA `device`'s Gpu, as Triton reads it (the shared memory past which a launch fails to compile); HOPPER
    elsewhere."""
    if device.type != "cuda":
        return HOPPER
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    return Gpu(props["multiprocessor_count"], props["max_shared_mem"])


def long_call(M: int, N: int, K: int) -> bool:
    """Whether `rows_kernel` at M rows of a weight [N, K] is a long call: up to ROWS_FEW rows of a large weight over at
    least ROWS_LONG_MIN_K inputs, whose programs stream for tens of µs on a grid of about one program per SM. Where
    they share SMs (float8 copies: 48-72 KB of shared memory a program) they launch after the kernel before has
    finished, not under programmatic dependent launch (but where kernels release late, `releasing_late`, which places
    their programs whole): under it an 8B target's q/k/v and down on the kernel made its (5, 4, 8) step 6.68 ms (5.69
    on cuBLAS), and without it 5.53 (docs/perf.md, thirty-sixth entry). The cause is placement: where the kernel
    before lets a long call launch at once, its programs can land three to an SM (72 KB of shared memory each) on a
    third of the SMs, and a down took 51 against 34 µs (thirty-seventh entry). On bf16 weights they hold a whole SM
    instead (`whole_sm_call`). Shorter calls need PDL: without it SmolLM2's (8, 8, 64) step took 1.65 ms against
    1.40, and an 8B target's (6, 8, 48) 6.40 against 6.30 for its o at 48 rows (120 KB a program: one an SM)."""
    return M <= ROWS_FEW and _long_weight(N, K)


def whole_sm_call(M: int, N: int, K: int, float8: bool, on: Gpu = HOPPER) -> bool:
    """Whether `rows_kernel`'s served launch at M rows of a weight [N, K] on GPU `on` gives each program more than half
    an SM's shared memory (`rows_launch`), so that one program runs an SM: a long call on bf16 or fp16 weights (an 8B
    target's verification) or the same weights at up to ROWS_MAX rows (a (6, 8, 48) verification), where a program
    may ask WHOLE_SM_SHARED (Hopper; not an A100's 163 KB or sm_86/sm_89's 99 KB). Those let the next kernel
    launch at once under PDL (`launch_options`), even where kernels release late: a whole-SM call after one then
    starts each program as the one before leaves its SM, its first weights loading while the others finish, and the
    small kernels after one (rotary, attention) wait beside it. An 8B target's 32 layers of q/k/v, o, gate/up and down
    at 8 rows, back to back in a CUDA graph on an H100, took 5.01 ms against 5.33-5.37 at the launches before (one
    row: 4.51-4.52), and its (5, 4, 8) step --draft-fp8 6.90 against 7.20-7.25 ms; at 48 rows 5.31 against 5.68-5.71
    on cuBLAS (the o on the kernel, sharing SMs), and the (6, 8, 48) step 7.71 against 8.04-8.05; at 32 rows 5.14
    against 5.59-5.60, and a (6, 8, 32) step 7.41-7.42 against 7.84 (docs/perf.md, forty-fifth and forty-sixth
    entries)."""
    return not float8 and M <= ROWS_MAX and _long_weight(N, K) and on.shared >= WHOLE_SM_SHARED


def _long_weight(N: int, K: int) -> bool:
    """A weight [N, K] whose few-rows calls stream for tens of µs (`long_call`, `whole_sm_call`): a large one over a
    long K."""
    return N * K >= ROWS_LARGE_WEIGHT and K >= ROWS_LONG_MIN_K


def rows_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                norm: tuple[Tensor | None, float] | None = None, silu_mul_output: bool = False,
                residual: Tensor | None = None, donate_residual: bool = False, quantized: Fp8Weight | None = None
                ) -> Tensor:
    """`fused_linear` past one row (or on inputs its one-token kernel does not take): `rows_kernel` for a few rows (2 to
    ROWS_MAX: verification, a draft pass) of a small weight, in a long or whole-SM call of a larger one (`long_call`,
    `whole_sm_call`), or of a large one with a float8 copy (`quantized`, which it then reads: ROWS_FEW), with SiLU·mul
    and the residual add in its epilogue; cuBLAS (and `silu_mul`) with `weight` otherwise, adding a donated residual in
    its matmul (beta = 1, in place). The RMSNorm runs in its own launch before the matmul, but for a folded one (a unit
    weight, `fold_norm`): its 1 / RMS, a per-row scale that commutes with the matmul, scales the few-rows kernel's sums,
    or SiLU·mul's inputs after cuBLAS's gate/up.
    x [..., K], weight [N, K], residual [..., N] -> [..., N] ([..., N / 2] with silu_mul_output)."""
    N, K = weight.shape
    assert x.shape[-1] == K, f"input of {x.shape[-1]} features for a [{N}, {K}] weight"
    takes_rows, quantized = rows_operands(x, weight, quantized, silu_mul_output)
    if takes_rows:
        return rows_kernel(x, weight, bias, silu_mul_output, quantized, residual=residual, norm=norm)
    if norm is not None and norm[0] is None and silu_mul_output and bias is None and residual is None:
        return silu_mul(*F.linear(x, weight).chunk(2, dim=-1), rms_of=x, eps=norm[1])
    if norm is not None:
        x = rms_norm(x, *norm)
    if residual is not None and donate_residual and bias is None and not silu_mul_output and residual.is_contiguous():
        residual.view(-1, N).addmm_(x.reshape(-1, K), weight.t())
        return residual
    y = F.linear(x, weight, bias)
    y = silu_mul(*y.chunk(2, dim=-1)) if silu_mul_output else y
    return y if residual is None else residual + y


def rows_operands(x: Tensor, weight: Tensor, quantized: Fp8Weight | None, silu_mul_output: bool
                  ) -> tuple[bool, Fp8Weight | None]:
    """Whether `rows_matmul` runs x [..., K] @ weight [N, K]ᵀ (through SiLU·mul with `silu_mul_output`) in
    `rows_kernel`, and the float8 copy that reads (`quantized` where it reads one, else None). A joint gate/up weight
    is bounded by one half's entries: its call reads both halves, but in one launch where cuBLAS and `silu_mul` take
    two."""
    N, K = weight.shape
    M = x.numel() // K
    if quantized is not None and not reads_fp8_rows(M, N, K):
        quantized = None
    long = long_call(M, N, K) or whole_sm_call(M, N, K, quantized is not None, gpu(x.device))
    largest = ROWS_LONG_MAX_WEIGHT if long else ROWS_MAX_WEIGHT
    entries = N * K // (2 if silu_mul_output else 1)
    takes = (2 <= M <= ROWS_MAX and (entries <= largest or quantized is not None)
             and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and weight.is_contiguous())
    return takes, quantized


class RowsLaunch(NamedTuple):
    """How `rows_kernel` runs: BLOCK_N output columns a program, BLOCK_K inputs a step with `stages` loads in flight,
    `warps` a program, and `splits` programs sharing each tile's K."""

    block_n: int
    block_k: int
    stages: int
    warps: int
    splits: int


def small_weight_past_few_rows(M: int, N: int, K: int) -> bool:
    """Whether M rows through a weight [N, K] make a small weight's call past ROWS_FEW rows (SmolLM2's verification),
    which waits on its loads' latency, not its bytes (`rows_launch`, `rows_tile`)."""
    return M > ROWS_FEW and N * K < ROWS_LARGE_WEIGHT


def rows_tile(M: int, N: int, K: int) -> int:
    """The tile of rows (BLOCK_M) `rows_kernel` runs M rows in: the next power of two from 16, but 64 for a small weight
    past ROWS_FEW rows. At 17-32 rows that took SmolLM2's (4, 8, 32) step as served from 1.13 to 1.01 ms on an H100
    (1.13-1.14 on an H200), as cheap as a 48-node one (docs/perf.md, fifty-ninth entry). Why is not measured (a
    reading: a tile of 32 rows takes half the shared memory, so more of a call's programs share an SM). At a draft
    pass's 8 rows, 64 slowed the draft."""
    return ROWS_MAX if small_weight_past_few_rows(M, N, K) else max(16, triton.next_power_of_2(M))


def rows_launch(M: int, N_out: int, K: int, float8: bool, silu_mul: bool, on: Gpu = HOPPER) -> RowsLaunch:
    """The served launch of `rows_kernel` at M rows, N_out output columns, K inputs (of each half of a joint gate/up
    weight with `silu_mul`), on GPU `on`, from sweeps on an H200 and an H100 (docs/perf.md): 32 weight rows a program,
    long chunks of K for up to 16 rows of a long K, 4 stages of loads in flight, 4 warps; K split as `rows_splits` says.
    Whole-SM calls on bf16 weights (`whole_sm_call`) take more than half an SM's shared memory, one program an SM, as
    WHOLE_SM_LAUNCHES gives for their tile of rows: 32 weight rows where their tiles fit one wave, else 64 (an 8B
    target's q/k/v: 192 tiles of 32 on 132 SMs), and through SiLU·mul 64 rows of each half. Where a program may not ask
    that much, a long call through SiLU·mul takes 64 rows of each half in chunks of 64 (54 KB; four programs an SM).
    A small weight past ROWS_FEW rows (SmolLM2's verification) waits on its loads' latency, not its bytes: 16 weight
    rows a program (in tiles of 64 rows of x: `rows_tile`) in chunks of 64 with 6 stages, twice the programs, each
    with more of its K in flight (at 64 rows on an H100: q/k/v 2.88 against 3.26 µs at (32, 128, 4), gate/up 3.99
    against 4.96, down split three ways 3.86 against 4.59; the (8, 8, 64) step 1.29 against 1.33-1.34 ms:
    docs/perf.md, fifty-fourth entry).
    Float8 copies take 64 weight rows and 3 stages, in chunks of 256 but where K, split four ways, leaves a program
    1,024 or fewer (an 8B target's q/k/v: 11.2-11.4 against 12.4-12.5 µs; o: 8.8-9.1 against 9.2-9.4)."""
    if float8:
        tiles = triton.cdiv(N_out, 64)
        block_k = 128 if tiles <= FP8_SPLIT_MAX_TILES and K <= 4 * 1024 else 256
        return RowsLaunch(64, block_k, 3, 4, rows_splits(tiles, triton.cdiv(K, block_k), True))
    N = (2 if silu_mul else 1) * N_out
    if whole_sm_call(M, N, K, float8, on):
        one_wave, other, through_silu = WHOLE_SM_LAUNCHES[rows_tile(M, N, K)]
        block_n, block_k, stages = through_silu if silu_mul else one_wave if triton.cdiv(N_out, 32) <= on.sms else other
    elif silu_mul and long_call(M, N, K):
        block_n, block_k, stages = 64, 64, 4
    elif small_weight_past_few_rows(M, N, K):
        block_n, block_k, stages = 16, 64, 6
    else:
        block_n, block_k, stages = 32, 256 if M <= ROWS_FEW and K >= 2048 else 128, 4
    return RowsLaunch(block_n, block_k, stages, 4,
                      rows_splits(triton.cdiv(N_out, block_n), triton.cdiv(K, block_k), False))


def rows_kernel(x: Tensor, weight: Tensor, bias: Tensor | None = None, silu_mul_output: bool = False,
                quantized: Fp8Weight | None = None, launch: RowsLaunch | None = None, residual: Tensor | None = None,
                norm: tuple[Tensor | None, float] | None = None) -> Tensor:
    """`rows_matmul`'s kernel, whatever the weight's size (`launch`: the served one unless given, as the linear
    benchmark sweeps them, a long call given one placed as one that shares SMs): tensor cores, under programmatic
    dependent launch but for long calls that share SMs where kernels release early (`long_call`; at their served
    launch, long calls on bf16 weights hold whole SMs and release the next kernel early: `whole_sm_call`), the first
    weights loaded before waiting on the kernel before (but in a small weight's tile of 64 rows: `early_first_chunk`)
    and a small weight's asked of L2 (`l2_prefetch`), SiLU·mul of the output's halves (`silu_mul_output`, a joint
    gate/up weight: one launch where cuBLAS and `silu_mul` take two) and the residual stream's add in the epilogue,
    reading the float8 copy `quantized` where given.
    Weights of few output columns split K over several programs (`rows_splits`). `norm` = (weight or None, eps): x goes
    through that RMSNorm first, in a launch of its own but for a folded norm (unit weight, `fold_norm`): where x holds
    its rows' squares (`RowSquares`, which a call adding the residual stream leaves on its output) the kernel scales
    its sums by 1 / RMS from them, and before an unsplit launch on a bf16/fp16 weight it sums x's squares in its loop
    (`_rows_matmul_kernel`'s NORM): one launch less either way. (A split program sees part of K; with float8 copies
    either way of summing the squares in the loop made an 8B head's (5, 4, 8) step 0.3 ms slower: docs/perf.md,
    thirty-fourth entry.)
    x [..., K] in the weight's dtype (bf16 or fp16), M = x.numel() / K rows, 1 to ROWS_MAX; weight [N, K]; residual
    [..., N] (N / 2 with SiLU·mul)."""
    N, K = weight.shape
    rows = as_rows(x)  # [M, K]
    M = len(rows)
    assert 1 <= M <= ROWS_MAX, f"{M} rows for rows_kernel, which takes 1 to {ROWS_MAX}"
    N_out = N // 2 if silu_mul_output else N
    block_m = rows_tile(M, N, K)
    float8, on = quantized is not None, gpu(x.device)
    whole_sm = launch is None and whole_sm_call(M, N, K, float8, on)  # a launch given is timed as one sharing SMs
    launch = as_run(launch, K) if launch else rows_launch(M, N_out, K, float8, silu_mul_output, on)
    placement = (Placement.WHOLE_SM if whole_sm else Placement.SHARES_SM if long_call(M, N, K)
                 else Placement.SHORT)
    block_n, block_k, stages, warps, splits = launch
    squares_in = x.row_squares.sums if norm is not None and norm[0] is None and has_row_squares(x) else None
    if norm is not None and squares_in is None and (norm[0] is not None or splits > 1 or float8):
        rows, norm = rms_norm(rows, *norm), None
    tiles = triton.cdiv(N_out, block_n)
    prefetch = l2_prefetch(N, K, splits, block_k, float8)
    out = torch.empty(*x.shape[:-1], N_out, dtype=x.dtype, device=x.device)
    assert residual is None or residual.shape == out.shape, f"residual {tuple(residual.shape)} for {tuple(out.shape)}"
    res = as_rows(residual) if residual is not None else out  # [M, N_out]
    partials = counters = out  # unused pointers without a split
    squares_out = None  # where the output's squares go (`RowSquares`) [M, tiles]
    if residual is not None and not torch.is_inference_mode_enabled():
        squares_out = torch.empty(M, tiles, dtype=torch.float32, device=x.device)
    if splits > 1:  # each program's sums [BLOCK_M, BLOCK_N] (two with SiLU·mul), and the tiles' arrival counts
        assert tiles <= SPLIT_MAX_TILES, f"{tiles} tiles split, for {SPLIT_MAX_TILES} counters"
        partials = torch.empty(splits, tiles, 2, block_m, block_n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device)
    _rows_matmul_kernel[(tiles, splits)](
        rows, *_weight_and_scale(weight, quantized), bias if bias is not None else weight, res, out, partials,
        counters, squares_in if squares_in is not None else out, squares_out if squares_out is not None else out,
        squares_in.shape[1] if squares_in is not None else 0, M, N_out, K, rows.stride(0), res.stride(0),
        norm[1] if norm is not None else 0.0,
        HAS_BIAS=bias is not None, HAS_SCALE=quantized is not None, SILU_MUL=silu_mul_output,
        HAS_RESIDUAL=residual is not None, NORM=norm is not None and squares_in is None,
        SQUARES_IN=triton.next_power_of_2(squares_in.shape[1]) if squares_in is not None else 0,
        SQUARES_OUT=squares_out is not None, SQUARES_BY_DOT=block_m < ROWS_MAX, SPLITS=splits,
        PREFETCH=prefetch, EARLY_CHUNK=early_first_chunk(block_m, prefetch),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_stages=stages, num_warps=warps,
        **launch_options(x.device, placement),
    )
    if squares_out is not None:
        out.row_squares = RowSquares(squares_out, out._version)
    return out


class RowSquares(NamedTuple):
    """What a `rows_kernel` call that adds the residual stream leaves on its output y [..., N] (as the attribute
    `row_squares`): each row's sums of its squares over each output tile, sums [M, tiles] fp32, of y as written (torch's
    `_version` of y then). A call normalising y by a folded RMSNorm next (a layer's gate/up after its o, the next
    layer's q/k/v after its down, a draft head's lm_head after its down) scales its own sums by 1 / RMS from them,
    where it would launch `rms_norm` first (on float8 copies, or split) or sum y's squares in its loop (NORM): the
    8B's (6, 8, 48) step 7.05 against 7.07 ms (the draft's float8 calls alone: 7.07), (5, 4, 8) 6.50 against 6.52,
    SmolLM2's (6, 8, 64) 1.01 against 1.02 (docs/perf.md, sixty-ninth entry). A view of y, or y changed in place since,
    has none; nor does one made under `torch.inference_mode` (whose tensors count no versions)."""

    sums: Tensor
    version: int


def has_row_squares(x: Tensor) -> bool:
    """Whether x holds its rows' squares as written (`RowSquares`), unchanged since."""
    found = getattr(x, "row_squares", None)
    return found is not None and found.version == x._version


def l2_prefetch(N: int, K: int, splits: int, block_k: int, float8: bool) -> int:
    """How many inputs of each of its weight rows a `rows_kernel` program asks L2 for before waiting on the kernel
    before (a power of two, at least its run of K; 0: none): all of them for a small bf16/fp16 weight (whose calls
    are short ones, never long or whole-SM), whose loads after the wait then come from L2 (the one-token kernel loads
    such a weight's whole rows before its wait); none for large weights, whose streams the wait does not hold up.
    SmolLM2's calls at 64 rows took 2.46-3.79 against 2.78-3.99 µs a call, at 8 rows 2.20-2.97 against 2.55-3.67,
    and its (8, 8, 64) step 1.27 against 1.29 ms (one H100: docs/perf.md, fifty-fourth entry)."""
    if float8 or N * K >= ROWS_LARGE_WEIGHT:
        return 0
    return max(64, triton.next_power_of_2(triton.cdiv(triton.cdiv(K, block_k), splits) * block_k))


def early_first_chunk(block_m: int, prefetch: int) -> bool:
    """Whether a `rows_kernel` program loads its first chunk of weights before its wait and sums it ahead of its
    pipelined loop, or runs every chunk in the loop: the second for a small weight in a tile of 64 rows (its weights
    asked of L2 before the wait: `l2_prefetch`), whose first chunk ahead of the loop waited on its inputs outside the
    pipeline. SmolLM2's calls at 64 rows, each weight's 30 layers back to back on an H100: q/k/v 3.27 against 3.61 µs,
    o 2.68 against 2.81, gate/up 3.95 against 4.11, down 3.92 against 4.08; its (6, 8, 64) step as served 1.02
    against 1.04 ms, (8, 8, 64) 1.10 against 1.11-1.13. In tiles of 16 rows the loop alone was slower (gate/up at 8
    rows 3.82 against 3.30 µs: docs/perf.md, sixty-fourth entry)."""
    return not prefetch or block_m < ROWS_MAX


def reads_fp8_rows(M: int, N: int, K: int) -> bool:
    """Whether `rows_matmul` reads a float8 copy of a weight [N, K] at M rows (2 <= M <= ROWS_MAX): of a large weight
    up to ROWS_FEW rows. There they beat cuBLAS on the bf16 weight at 4 and 8 rows (q/k/v 22 against 28 µs, the fc
    22 against 31), with K split over programs (`rows_splits`). At 48 rows cuBLAS on the bf16 weight was faster
    (docs/perf.md), and the bf16 weight's whole-SM call is now faster still; a small weight's few-rows call is bound
    by its latency, not its bytes."""
    return M <= ROWS_FEW and N * K >= ROWS_LARGE_WEIGHT


SPLIT_MAX_TILES = 512  # the arrival counters' length: the most tiles any split launch may have (linear_bench's
# grid; the served splits reach FP8_SPLIT_MAX_TILES at most)
FP8_SPLIT_MAX_TILES = 128  # the most tiles whose K `rows_splits` splits where they read float8 copies
SPLIT_PROGRAMS = 108  # about the most programs `rows_splits` makes of a bf16 weight's few tiles


def rows_splits(tiles: int, chunks: int, float8: bool) -> int:
    """How many programs share each of `tiles` tiles' K (`chunks` of BLOCK_K), from a sweep on an H200 (docs/perf.md).
    Converting float8 weights bounds a program, so narrow ones gain from more programs: four on up to
    FP8_SPLIT_MAX_TILES tiles (an 8B head's q/k/v, o, down and fc at 4 and 8 rows); its gate/up (224 tiles of 64
    columns) is fastest unsplit (35 against 46 µs with four: docs/perf.md, thirty-fifth entry). In bf16
    only a long K over few tiles gains, up to about SPLIT_PROGRAMS programs (SmolLM2's down, 576 x 1536: 2.9 against
    4.4 µs with six of its 18 tiles of 32 at 8 rows; at 64 rows three of its 36 tiles of 16, 3.86 against 4.77 µs
    unsplit in the sweep before); elsewhere the sums' round trip costs more than the extra programs give."""
    if float8:
        splits = min(4, chunks) if tiles <= FP8_SPLIT_MAX_TILES else 1
    else:
        splits = min(6, chunks // 2, SPLIT_PROGRAMS // tiles) if tiles <= 64 and chunks >= 12 else 1
    return equal_runs(chunks, splits)


def as_run(launch: RowsLaunch, K: int) -> RowsLaunch:
    """`launch` as `rows_kernel` runs it over K inputs: its splits as equal runs of whole chunks of K (`equal_runs`)."""
    return launch._replace(splits=equal_runs(triton.cdiv(K, launch.block_k), launch.splits))


def equal_runs(chunks: int, splits: int) -> int:
    """At most `splits` programs that share `chunks` chunks of K in runs of equal whole chunks, none empty."""
    return triton.cdiv(chunks, triton.cdiv(chunks, max(1, min(splits, chunks))))


@functools.cache
def _split_counters(device: torch.device) -> Tensor:
    """[SPLIT_MAX_TILES] int32 zeros, one per device, shared by every split `rows_matmul`: each program of a tile
    adds one to its count, and the last resets it. Kernels of one stream run one after another (under PDL the
    next touches them only after `follow`), so they never share a count."""
    return torch.zeros(SPLIT_MAX_TILES, dtype=torch.int32, device=device)


@jit
def _rows_matmul_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, res_ptr, out_ptr, partials_ptr, counters_ptr,
                        squares_in_ptr, squares_out_ptr, squares_in_tiles, M, N, K, stride_x, stride_res, eps,
                        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SILU_MUL: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, SQUARES_IN: tl.constexpr,
                        SQUARES_OUT: tl.constexpr, SQUARES_BY_DOT: tl.constexpr, SPLITS: tl.constexpr,
                        PREFETCH: tl.constexpr, EARLY_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out [M, N] = x [M, K] @ w [N, K]^T, BLOCK_N output columns a program, all M rows (padded to BLOCK_M). With
    SILU_MUL, w is [2N, K] (gate rows, then up rows) and the program takes BLOCK_N rows of each: out = silu(x @
    gateᵀ) * (x @ upᵀ), rounded where the reference's linear output, F.silu and the product are. With HAS_SCALE, w is
    a float8 copy (made x's dtype by `_e4m3_values`) and each output column is scaled by its row's scale_ptr entry
    (`serve/fp8.py`): the products of x and the float8 values are exact in the dot's fp32, and so are the
    power-of-two scales. With HAS_RESIDUAL, out = res [M, N] + that, rounded as the reference's add. With NORM (one
    split, no float8), x's rows are first normalised by a unit-weight RMSNorm of `eps`: the loop also sums the rows'
    squares, and the sums are scaled by each row's 1 / RMS before the epilogue. With SQUARES_IN (a power of two, at
    least squares_in_tiles) the same norm takes the rows' squares from squares_in [M, squares_in_tiles], summed over
    its tiles (`RowSquares`); with SQUARES_OUT the epilogue writes each row's sum of its stored outputs' squares to
    squares_out [M, tiles]. With SQUARES_BY_DOT (tiles of 16 or 32 rows) it forms x xᵀ on the tensor cores, whose
    diagonal holds them; in a tile of 64 rows it adds x's squares elementwise into [BLOCK_M, BLOCK_K] and sums across
    once, after the loop. There x xᵀ took as long as the matmul
    (SmolLM2's four linears of a layer at 64 rows 14.7-14.8 µs against 13.4 with no norm, 14.0-14.2 elementwise;
    its (8, 8, 64) step 1.11 against 1.13-1.14 ms as served); at 8 and 16 rows elementwise took 3.4 µs a layer more
    (one H100: docs/perf.md, sixty-fourth entry). A sum over each chunk's columns took two more barriers a chunk.

    With SPLITS > 1, program (tile, split) sums one of SPLITS equal runs of K's chunks and writes its sums to
    partials [SPLITS, tiles, 2, BLOCK_M, BLOCK_N]; the tile's last program to arrive (counters_ptr) adds the
    SPLITS sums in split order, so the result does not depend on which program is last, and finishes the tile."""
    tile, split = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    run = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLITS) * BLOCK_K  # this program's K: begin .. end
    begin = split * run
    end = tl.minimum(begin + run, K)
    n_ok, m_ok = n < N, m < M
    # [BLOCK_N, 1]; rows past N (masked off) at row N - 1, so that no address, not even a prefetch's, leaves w
    w_rows = w_ptr + tl.minimum(n, N - 1)[:, None].to(tl.int64) * K
    x_rows = x_ptr + m[:, None] * stride_x  # [BLOCK_M, 1]
    if EARLY_CHUNK:  # the first weight chunk loads before waiting on the kernel before (no kernel writes weights)
        kk = begin + k
        ok = n_ok[:, None] & (kk < end)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=ok, other=0.0)  # [BLOCK_N, BLOCK_K]
        w_up = tl.load(w_rows + N * K + kk[None, :], mask=ok & SILU_MUL, other=0.0)
    if PREFETCH:  # the weights into L2, so that after the wait the loop's loads wait on L2, not DRAM
        _weights_to_l2(w_rows, begin, end, PREFETCH)
        if SILU_MUL:
            _weights_to_l2(w_rows + N * K, begin, end, PREFETCH)
    follow(PDL)
    if SQUARES_IN:  # x's rows' squares as the call that wrote x summed them, a tile of its columns each [BLOCK_M,
        # SQUARES_IN] (a row's sums adjacent: summed within threads and warps); loaded before the loop, so that their
        # load's latency is not added to the end
        t = tl.arange(0, SQUARES_IN)
        row_squares = tl.sum(tl.load(squares_in_ptr + m[:, None] * squares_in_tiles + t[None, :],
                                     mask=m_ok[:, None] & (t < squares_in_tiles)[None, :], other=0.0), 1)
    res = tl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty)  # HAS_RESIDUAL only: loaded before the loop (added
    if HAS_RESIDUAL:  # after it, an 8B target's o took 0.5 µs more a call at 8 rows; docs/perf.md, thirty-third entry)
        res = tl.load(res_ptr + m[:, None] * stride_res + n[None, :], mask=m_ok[:, None] & n_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # SILU_MUL only
    if SQUARES_BY_DOT:  # NORM only: x xᵀ, whose diagonal holds the rows' sums of squares
        squares = tl.zeros([BLOCK_M, BLOCK_M], tl.float32)
    else:  # or x's squares, summed over the chunks
        squares = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    if EARLY_CHUNK:
        acc, acc_up, squares = _rows_chunk(x_rows, w, w_up, acc, acc_up, squares, m_ok, kk, end, HAS_SCALE,
                                           SILU_MUL, NORM, SQUARES_BY_DOT)
    for start in range(begin + BLOCK_K if EARLY_CHUNK else begin, end, BLOCK_K):
        kk = start + k
        ok = n_ok[:, None] & (kk < end)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=ok, other=0.0)
        w_up = tl.load(w_rows + N * K + kk[None, :], mask=ok, other=0.0) if SILU_MUL else w
        acc, acc_up, squares = _rows_chunk(x_rows, w, w_up, acc, acc_up, squares, m_ok, kk, end, HAS_SCALE,
                                           SILU_MUL, NORM, SQUARES_BY_DOT)
    if NORM:
        tl.static_assert(SPLITS == 1 and not HAS_SCALE, "a folded norm needs all of K in one program, unscaled")
        if SQUARES_BY_DOT:
            squares = tl.where(m[:, None] == m[None, :], squares, 0.0)
        row_squares = tl.sum(squares, 1)
    if NORM or SQUARES_IN:
        rstd = tl.rsqrt(row_squares / K + eps)[:, None]  # as `_rstd`; each split scales its own sums
        acc *= rstd
        if SILU_MUL:
            acc_up *= rstd
    squares_out = squares_out_ptr + m * tl.num_programs(0) + tile  # SQUARES_OUT only: this tile's sums [BLOCK_M]
    if SPLITS == 1:
        _rows_epilogue(acc, acc_up, scale_ptr, bias_ptr, res, out_ptr, squares_out, m, n, m_ok, n_ok, N, HAS_BIAS,
                       HAS_SCALE, SILU_MUL, HAS_RESIDUAL, SQUARES_OUT)
    else:
        tile_sums = partials_ptr + (m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])  # [BLOCK_M, BLOCK_N]
        size = 2 * BLOCK_M * BLOCK_N  # one program's sums
        own = tile_sums + (split * tl.num_programs(0) + tile) * size  # this program's sums
        tl.store(own, acc)
        if SILU_MUL:
            tl.store(own + BLOCK_M * BLOCK_N, acc_up)
        tl.debug_barrier()  # every thread's sums written before the count that releases them
        if tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel") == SPLITS - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLITS):
                sums = tile_sums + (s * tl.num_programs(0) + tile) * size
                acc += tl.load(sums, cache_modifier=".cg")
                if SILU_MUL:
                    acc_up += tl.load(sums + BLOCK_M * BLOCK_N, cache_modifier=".cg")
            tl.store(counters_ptr + tile, 0)
            _rows_epilogue(acc, acc_up, scale_ptr, bias_ptr, res, out_ptr, squares_out, m, n, m_ok, n_ok, N,
                           HAS_BIAS, HAS_SCALE, SILU_MUL, HAS_RESIDUAL, SQUARES_OUT)


@jit
def _weights_to_l2(w_rows, begin, end, SPAN: tl.constexpr):
    """Asks L2 for the 2-byte weights w_rows [BLOCK_N, 1] + [begin, end), a 128-byte line at a time, without waiting
    for them or holding them in registers (`prefetch.global.L2`; nothing under the interpreter). SPAN: a power of two
    at least end - begin; the lines past `end` ask for its last one again."""
    if COMPILED:
        lines = tl.minimum(begin + tl.arange(0, SPAN // 64) * 64, end - 1)  # a line's first weight [SPAN / 64]
        tl.inline_asm_elementwise("mov.b32 $0, 0; prefetch.global.L2 [$1];", "=r,l", [w_rows + lines[None, :]],
                                  dtype=tl.int32, is_pure=False, pack=1)


@jit
def _rows_epilogue(acc, acc_up, scale_ptr, bias_ptr, res, out_ptr, squares_ptr, m, n, m_ok, n_ok, N,
                   HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                   SQUARES_OUT: tl.constexpr):
    """`_rows_matmul_kernel`'s end: the sums acc (acc_up) [BLOCK_M, BLOCK_N] of output columns n scaled, biased,
    through SiLU·mul, added to the residual stream's tile res, and stored; with SQUARES_OUT each row's sum of the
    stored values' squares to the pointers squares_ptr [BLOCK_M]."""
    dtype = out_ptr.dtype.element_ty
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + n, mask=n_ok, other=0.0)[None, :] * _e4m3_unscale(dtype)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        if HAS_SCALE:
            acc_up *= tl.load(scale_ptr + N + n, mask=n_ok, other=0.0)[None, :] * _e4m3_unscale(dtype)
        if HAS_BIAS:
            acc_up += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc = _silu_mul_rounded(acc, acc_up, dtype)
    if HAS_RESIDUAL:
        acc = acc.to(dtype).to(tl.float32) + res.to(tl.float32)
    stored = acc.to(dtype)
    tl.store(out_ptr + m[:, None] * N + n[None, :], stored, mask=m_ok[:, None] & n_ok[None, :])
    if SQUARES_OUT:  # columns past N hold zeros: their weights load as 0
        stored = stored.to(tl.float32)
        tl.store(squares_ptr, tl.sum(stored * stored, 1), mask=m_ok)


@jit
def _silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in fp32 from a projection's fp32 outputs, rounded as torch rounds them in `dtype`: gate and
    up (the projection's outputs), and F.silu's."""
    gate = gate.to(dtype).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)


@jit
def _rows_chunk(x_rows, w, w_up, acc, acc_up, squares, m_ok, kk, end, HAS_SCALE: tl.constexpr,
               SILU_MUL: tl.constexpr, NORM: tl.constexpr, SQUARES_BY_DOT: tl.constexpr):
    """`_rows_matmul_kernel`'s step over the input chunk kk [BLOCK_K] (columns from `end` on masked): acc
    [BLOCK_M, BLOCK_N] += x[:, kk] @ w^T, w [BLOCK_N, BLOCK_K] the chunk's weights (and acc_up with w_up); with NORM,
    squares [BLOCK_M, BLOCK_M] += x[:, kk] @ x[:, kk]^T (SQUARES_BY_DOT), else squares [BLOCK_M, BLOCK_K] += x[:, kk]²
    (each product exact in fp32 either way). With HAS_SCALE the weights are float8, made x's dtype by
    `_e4m3_values` and x scaled to match (`_e4m3_x`), exactly."""
    x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < end)[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
    if NORM and SQUARES_BY_DOT:
        squares = tl.dot(x, tl.trans(x), squares)
    elif NORM:
        x32 = x.to(tl.float32)
        squares += x32 * x32
    if HAS_SCALE:
        w, x = _e4m3_values(w, x.dtype), _e4m3_x(x)
    acc = tl.dot(x, tl.trans(w), acc)
    if SILU_MUL:
        acc_up = tl.dot(x, tl.trans(_e4m3_values(w_up, x.dtype) if HAS_SCALE else w_up), acc_up)
    return acc, acc_up, squares


def _e4m3_ptx(shift: int, lane_mask: int) -> str:
    """PTX making four float8 e4m3 values (their bytes in $2) two pairs of 16-bit values ($0: the first two, $1: the
    last two; the first of each in the low lane): `prmt` spreads the bytes into 16-bit lanes, each above copies of its
    own sign bit (selector nibbles 8-B copy a byte's sign), and one shift and one mask of `lane_mask` in each lane
    make both lanes of a pair."""
    mask = lane_mask << 16 | lane_mask
    return (f"prmt.b32 $0, $2, 0, 0x9180; prmt.b32 $1, $2, 0, 0xB3A2; shl.b32 $0, $0, {shift}; "
            f"shl.b32 $1, $1, {shift}; and.b32 $0, $0, {mask:#x}; and.b32 $1, $1, {mask:#x};")


# e4m3's exponent and mantissa bits moved into bf16's (fp16's) low exponent bits and high mantissa bits, the sign
# into its sign bit: the value times 2^-120 (2^-8), exactly, subnormals and zero included.
E4M3_TO_BF16 = tl.constexpr(_e4m3_ptx(4, 0x87F0))
E4M3_TO_FP16 = tl.constexpr(_e4m3_ptx(7, 0xBF80))


@jit
def _e4m3_values(w, dtype: tl.constexpr):
    """Float8 e4m3 values -> the same in `dtype` (bf16 or fp16) times 2^-(dtype's exponent bias - 7),
    exactly: the sign, exponent and mantissa bits shifted into dtype's fields and the rest masked off (e4m3's 4
    exponent bits are the low ones of dtype's field, so its subnormals and zero stay so). Integer ops at full rate,
    where the conversion instructions (e4m3 -> fp16 -> bf16) run at a quarter: few-rows matmuls 2-9% faster at
    Llama-3.1-8B's shapes (docs/perf.md). Compiled, four values a time in three instructions a pair
    (`E4M3_TO_BF16`), where the compiler's own code for the same ops took seven: with 64-row launches the few-rows
    calls on float8 copies 7-26% faster at an 8B target's shapes (thirty-fifth entry). The factor, 2^-120 in bf16
    and 2^-8 in fp16, comes back in `_e4m3_x` and `_e4m3_unscale`."""
    bits = w.to(tl.int8, bitcast=True)
    if COMPILED:
        ptx: tl.constexpr = E4M3_TO_BF16 if dtype == tl.bfloat16 else E4M3_TO_FP16
        lanes = tl.inline_asm_elementwise(ptx, "=r,=r,r", [bits], dtype=tl.int16, is_pure=True, pack=4)
    else:  # sign-extended, so that the sign lands on dtype's after the shift
        if dtype == tl.bfloat16:
            lanes = (bits.to(tl.int16) << 4) & -0x7810  # mask 0x87F0
        else:
            lanes = (bits.to(tl.int16) << 7) & -0x4080  # mask 0xBF80
    return lanes.to(dtype, bitcast=True)


@jit
def _e4m3_x(x):
    """The input that multiplies `_e4m3_values` of x's dtype: in bf16 x · 2^64, so that a product, 2^-56 of its value,
    stays a normal fp32 number for any value above 2^-70 (whether the tensor cores keep subnormal sums is not
    counted on); fp16's factor needs nothing."""
    if x.dtype == tl.float16:
        return x
    else:
        return x * 18446744073709551616.0  # 2^64


@jit
def _e4m3_unscale(dtype: tl.constexpr):
    """What sums of products of `_e4m3_values` (of `dtype`) and `_e4m3_x` are multiplied by: 2^56, fp16's 2^8."""
    return 256.0 if dtype == tl.float16 else 72057594037927936.0


def launch_config(N: int, K: int, float8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a weight [N, K], from sweeps of the kernel as it is (partial sums in
    registers, `_partial_sums`) on an H200 (docs/perf.md, forty-fourth entry): a large vocabulary's lm_head (Llama 3's
    128,256 rows) and a small model's wide projections in short chunks of K over thousands of programs; Llama-3.1-8B's
    projections (K >= 4096) 8 rows a program in chunks of 2048 with 8 warps (q/k/v 14.0 -> 13.4 µs, gate/up's 28,672
    rows 58.4 -> 56.3, down 30.2 -> 29.3), and so an 8B draft head's bf16 fc and 32,000-row lm_head (not timed);
    SmolLM2's (K 576, 1536), latency-bound, in one or two chunks of 4 warps (down 2.1 -> 1.5 µs). A float8 copy's
    partial sums take a sixteenth of the registers, so its programs hold chunks twice as long, or twice as many rows
    (an 8B head's gate/up 38.1 -> 31.8 µs, down 18.7 -> 16.7: forty-third entry)."""
    if float8 and K >= 4096:
        return (16, 512, 4) if N >= 16384 else (8, 2048, 8)
    if N >= 65536 or (N >= 16384 and K < 4096):
        return 16, 256, 4
    if K >= 4096:
        return 8, 2048, 8
    return (8, 1024, 4) if K <= 1024 else (4, 2048, 4)


@triton.jit
def _fused_linear_kernel(x_ptr, res_ptr, w_ptr, scale_ptr, bias_ptr, norm_w_ptr, out_ptr, N, K, eps,
                         HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr, NORM_WEIGHT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SILU_MUL: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One row x [K] against BLOCK_N rows of w [N, K] (with SILU_MUL, w is [2N, K]: gate rows, then up rows, and the
    program reads BLOCK_N of each): products summed over K at the end (fp32 partial sums [BLOCK_N, BLOCK_K / R], so
    each load's reduction does not wait on the last). The products of one thread's 16-byte load of weights (16 float8
    or 8 bf16/fp16 ones) are summed in registers first, R at a time: the partial sums then take an R-th of the
    registers (an 8B head's float8 q/k/v 126 -> 72 a thread, its down 117 -> 48), so an SM holds more programs and
    more weight bytes are in flight (docs/perf.md, forty-second and forty-third entries).

    The norm is folded out of the sum: y = rstd * sum(w * x * norm_w) (norm_w 1 without NORM_WEIGHT), its mean
    square gathered in the same loop, so the weight loads start at once. (The reference rounds the normed input to
    the input dtype twice; this rounds nothing before the sum, a difference below the output's own rounding.) With
    HAS_SCALE, w is float8 and each output is scaled by its row's scale_ptr entry (`serve/fp8.py`). With
    HAS_RESIDUAL, out = res [N] + that, rounded as the reference's add."""
    program = tl.program_id(0)
    n = program * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = w_ptr + n[:, None].to(tl.int64) * K  # [BLOCK_N, 1]
    k = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    # The first chunk of weights is loaded before waiting on the kernel before (no kernel writes weights).
    ok = n_ok[:, None] & (k < K)[None, :]
    w = tl.load(rows + k[None, :], mask=ok, other=0.0)  # [BLOCK_N, BLOCK_K]
    w_up = tl.load(rows + N * K + k[None, :], mask=ok & SILU_MUL, other=0.0)
    follow(PDL)
    R: tl.constexpr = 16 if HAS_SCALE else 8
    acc = tl.zeros([BLOCK_N, BLOCK_K // R], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K // R], tl.float32)  # SILU_MUL only
    squares = tl.zeros([BLOCK_K], tl.float32)  # HAS_NORM only
    acc, acc_up, squares = _linear_chunk(x_ptr, norm_w_ptr, w, w_up, acc, acc_up, squares, k, K, HAS_NORM,
                                         NORM_WEIGHT, SILU_MUL, R)
    for start in range(BLOCK_K, K, BLOCK_K):
        kk = start + k
        ok = n_ok[:, None] & (kk < K)[None, :]
        w = tl.load(rows + kk[None, :], mask=ok, other=0.0)
        if SILU_MUL:
            w_up = tl.load(rows + N * K + kk[None, :], mask=ok, other=0.0)
        acc, acc_up, squares = _linear_chunk(x_ptr, norm_w_ptr, w, w_up, acc, acc_up, squares, kk, K, HAS_NORM,
                                             NORM_WEIGHT, SILU_MUL, R)
    y = tl.sum(acc, 1)  # [BLOCK_N]
    if HAS_SCALE:
        y *= tl.load(scale_ptr + n, mask=n_ok, other=0.0)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
        y *= rstd
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    if SILU_MUL:  # silu(gate) * up on the projection's rounded outputs, rounded where F.silu and the product are
        up = tl.sum(acc_up, 1)
        if HAS_SCALE:
            up *= tl.load(scale_ptr + N + n, mask=n_ok, other=0.0)
        if HAS_NORM:
            up *= rstd
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)
        y = _silu_mul_rounded(y, up, dtype)
    if HAS_RESIDUAL:
        y = y.to(dtype).to(tl.float32) + tl.load(res_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(dtype), mask=n_ok)


@jit
def _linear_chunk(x_ptr, norm_w_ptr, w, w_up, acc, acc_up, squares, kk, K, HAS_NORM: tl.constexpr,
                  NORM_WEIGHT: tl.constexpr, SILU_MUL: tl.constexpr, R: tl.constexpr):
    """`_fused_linear_kernel`'s step over the input chunk kk [BLOCK_K], its weights w (w_up) [BLOCK_N, BLOCK_K]
    (float8 ones converted by the conversion instructions, here faster than `_e4m3_values`: docs/perf.md), into the
    partial sums acc (acc_up) [BLOCK_N, BLOCK_K / R]."""
    k_ok = kk < K
    a = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
    if HAS_NORM:
        squares += a * a
        if NORM_WEIGHT:
            a *= tl.load(norm_w_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    acc += _partial_sums(w.to(tl.float32) * a[None, :], R)
    if SILU_MUL:
        acc_up += _partial_sums(w_up.to(tl.float32) * a[None, :], R)
    return acc, acc_up, squares


@jit
def _partial_sums(products, R: tl.constexpr):
    """products [BLOCK_N, BLOCK_K] -> the sums of each R adjacent ones [BLOCK_N, BLOCK_K / R]."""
    return tl.sum(tl.reshape(products, [products.shape[0], products.shape[1] // R, R]), 2)


FUSED = Kernels(rms_norm=rms_norm, rotary=rotary, silu_mul=silu_mul, linear=fused_linear, norm_cat=norm_cat)
