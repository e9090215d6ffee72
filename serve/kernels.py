"""Fused Triton kernels for inference: RMSNorm (optionally after the residual add), rotary on q and k, SiLU·mul;
and for speculation, the draft's top-k log-probs and greedy verification's walk down the tree.

Each replaces a chain of small torch kernels with one launch (RMSNorm alone is eight: cast, pow, mean, add,
rsqrt, mul, cast, mul by the weight), which is what a batch-1 decode step spends much of its time on. Each
reproduces the torch reference in `eyas.common.layers` rounding for rounding: arithmetic runs in fp32 (as
torch's CUDA kernels compute half types in fp32), and every intermediate the reference materialises in a half
dtype is rounded to that dtype here too. Results equal the reference up to fp32 reduction order and the fast
rsqrt/exp.

The model stays defined once (`eyas.common`): its layers call their `kernels` (`common.layers.Kernels`, torch by
default), and the engine installs `FUSED` on the models it serves on CUDA when triton is installed, whatever
the attention backend (`install`); the drafter and the target pass's graph take `top_log_probs` and
`verify_greedy` in place of their torch references (`serve.tree`, `serve.verify`), which they equal. They have no
backward: the trainer keeps the torch kernels. Launches read
sizes from tensor shapes only and never sync the host, so CUDA graphs capture them. Triton launches on the
current CUDA device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from eyas.common.layers import KERNEL_USERS, Kernels

from . import tree

jit = triton.jit


def install(model: nn.Module, kernels: Kernels | None = None) -> None:
    """Makes every layer of `model` use `kernels` (default: the fused ones, inference only: no backward)."""
    for module in model.modules():
        if isinstance(module, KERNEL_USERS):
            module.kernels = kernels or FUSED


def _rows(x: Tensor) -> Tensor:
    """x [..., N] -> [rows, N] with unit stride along N (a view where possible)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(1) == 1 else x.contiguous()


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """RMSNorm.forward over the last dim, one program per row: x [..., N], weight [N] -> [..., N].

    With `residual` (same shape): s = x + residual, rounded to their dtype -> (norm(s), s), as the reference's
    `x = x + residual` followed by the norm. Outputs are new contiguous tensors; the norm's dtype is the
    reference's (weight's and input's promoted).
    """
    n = x.shape[-1]
    rows = _rows(x)
    if residual is None:
        res, summed = rows, None  # placeholders: without a residual the kernel neither reads res nor writes a sum
        in_dtype = x.dtype
    else:
        assert residual.shape == x.shape
        res = _rows(residual)
        in_dtype = torch.promote_types(x.dtype, residual.dtype)
        summed = torch.empty(x.shape, dtype=in_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, in_dtype), device=x.device)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res, weight.contiguous(), out, out if summed is None else summed, rows.stride(0), res.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 512, 1), 16),
    )
    return out if summed is None else (out, summed)


@jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_res, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / N + eps)
    normed = (x32 * rstd).to(x.dtype)  # the reference casts back to the input dtype before the weight
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """apply_rotary on q [B, T, Hq, D] and k [B, T, Hkv, D] in one launch; cos, sin [B or 1, T, D].

    One program per token rotates all its q and k heads. -> new contiguous (q, k) in the reference's dtypes.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    assert k.shape == (B, T, Hkv, D) and D % 2 == 0 and cos.dtype == sin.dtype
    q, k = (x if x.stride(3) == 1 else x.contiguous() for x in (q, k))
    cos, sin = (x.expand(B, T, D) for x in (cos, sin))
    cos, sin = (x if x.stride(2) == 1 else x.contiguous() for x in (cos, sin))
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
    k_out = torch.empty(k.shape, dtype=torch.promote_types(k.dtype, cos.dtype), device=k.device)
    _rotary_kernel[(B * T,)](
        q, k, cos, sin, q_out, k_out, T, *q.stride()[:3], *k.stride()[:3], *cos.stride()[:2], *sin.stride()[:2],
        Hq, Hkv, HALF=D // 2, BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HKV=triton.next_power_of_2(Hkv),
        BLOCK_HALF=triton.next_power_of_2(D // 2),
    )
    return q_out, k_out


@jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, T,
                   stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_cb, stride_ct,
                   stride_sb, stride_st, HQ, HKV, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                   BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    b, t = token // T, token % T
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    # The two halves of cos and sin [BLOCK_HALF] (equal for Rotary's tables, but the reference reads both).
    c = cos_ptr + b * stride_cb + t * stride_ct + d
    s = sin_ptr + b * stride_sb + t * stride_st + d
    c1, c2 = tl.load(c, mask=d_ok).to(tl.float32), tl.load(c + HALF, mask=d_ok).to(tl.float32)
    s1, s2 = tl.load(s, mask=d_ok).to(tl.float32), tl.load(s + HALF, mask=d_ok).to(tl.float32)
    _rotate_heads(q_ptr + b * stride_qb + t * stride_qt, stride_qh, q_out_ptr + token * HQ * 2 * HALF, HQ,
                  c1, c2, s1, s2, d, d_ok, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + b * stride_kb + t * stride_kt, stride_kh, k_out_ptr + token * HKV * 2 * HALF, HKV,
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


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """F.silu(gate) * up for two tensors of one shape [..., N] -> a new contiguous tensor in the reference's dtype.
    Rows may be strided (the two halves of a joint gate/up projection's output are read in place)."""
    assert gate.shape == up.shape
    gate_rows, up_rows = _rows(gate), _rows(up)  # [rows, N] each
    rows, n = gate_rows.shape
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    _silu_mul_kernel[(rows, triton.cdiv(n, 1024))](gate_rows, up_rows, out, n, gate_rows.stride(0),
                                                    up_rows.stride(0), BLOCK=1024)
    return out


@jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, stride_gate, stride_up, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(gate_ptr + row * stride_gate + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + i, mask=ok, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate_ptr.dtype.element_ty)  # F.silu rounds to gate's dtype
    tl.store(out_ptr + row * n + i, (silu.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=ok)


TOP_CHUNK = 2048  # vocabulary entries per program of `top_log_probs`' first kernel
TOP_MAX_K = 32  # larger k: the torch reference


def top_log_probs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`eyas.serve.tree.top_log_probs` (the k best of logits.float().log_softmax(-1), descending, and their
    indices) in two launches where torch takes about fifteen (cast, log-softmax, a multi-pass radix top-k).

    First, one program per (row, chunk of TOP_CHUNK entries) keeps its chunk's k best and its log-sum-exp terms
    [rows, chunks, ·]; then one program per row merges them. Among equal logits the lower index ranks first."""
    V = logits.shape[-1]
    assert 1 <= k <= V, f"top {k} of {V} entries"
    if k > TOP_MAX_K:
        return tree.top_log_probs(logits, k)
    x = _rows(logits)
    rows, chunks = x.shape[0], triton.cdiv(V, TOP_CHUNK)
    k_pow2, device = triton.next_power_of_2(k), logits.device
    best = torch.empty(rows, chunks, k_pow2, dtype=torch.float32, device=device)  # each chunk's k best logits
    where = torch.empty(rows, chunks, k_pow2, dtype=torch.int64, device=device)  # and their vocabulary indices
    maxima, sums = (torch.empty(rows, chunks, dtype=torch.float32, device=device) for _ in range(2))
    _chunk_top_kernel[(rows, chunks)](x, best, where, maxima, sums, x.stride(0), V, K=k, K_POW2=k_pow2,
                                      BLOCK=TOP_CHUNK, num_warps=8)
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    indices = torch.empty(rows, k, dtype=torch.int64, device=device)
    _merge_top_kernel[(rows,)](best, where, maxima, sums, values, indices, chunks, K=k, K_POW2=k_pow2,
                               CHUNKS_POW2=triton.next_power_of_2(chunks))
    shape = logits.shape[:-1] + (k,)
    return values.view(shape), indices.view(shape)


@jit
def _chunk_top_kernel(x_ptr, best_ptr, where_ptr, max_ptr, sum_ptr, stride_x, V, K: tl.constexpr,
                      K_POW2: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    chunks = tl.num_programs(1)
    m = tl.max(x, 0)
    tl.store(max_ptr + row * chunks + chunk, m)
    tl.store(sum_ptr + row * chunks + chunk, tl.sum(tl.exp(x - m), 0))
    slots = tl.arange(0, K_POW2)
    best = tl.full([K_POW2], float("-inf"), tl.float32)
    where = tl.zeros([K_POW2], tl.int64)
    for j in tl.static_range(K):  # the j-th best: the first maximum left, then taken out
        at = tl.argmax(x, 0)
        best = tl.where(slots == j, tl.max(x, 0), best)
        where = tl.where(slots == j, chunk * BLOCK + at, where)
        x = tl.where(tl.arange(0, BLOCK) == at, float("-inf"), x)
    out = (row * chunks + chunk) * K_POW2 + slots
    tl.store(best_ptr + out, best)
    tl.store(where_ptr + out, where)


@jit
def _merge_top_kernel(best_ptr, where_ptr, max_ptr, sum_ptr, values_ptr, indices_ptr, chunks, K: tl.constexpr,
                      K_POW2: tl.constexpr, CHUNKS_POW2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_POW2)
    m = tl.load(max_ptr + row * chunks + c, mask=c < chunks, other=float("-inf"))
    s = tl.load(sum_ptr + row * chunks + c, mask=c < chunks, other=0.0)
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
    # Candidates [CHUNKS_POW2 * K_POW2] in chunk order, each chunk's best first: the first maximum is the lowest index.
    i = tl.arange(0, CHUNKS_POW2 * K_POW2)
    ok = (i // K_POW2 < chunks) & (i % K_POW2 < K)
    cand = tl.load(best_ptr + row * chunks * K_POW2 + i, mask=ok, other=float("-inf"))
    for j in tl.static_range(K):
        at = tl.argmax(cand, 0)
        tl.store(values_ptr + row * K + j, tl.max(cand, 0) - lse)
        tl.store(indices_ptr + row * K + j, tl.load(where_ptr + row * chunks * K_POW2 + at))
        cand = tl.where(i == at, float("-inf"), cand)


def verify_greedy(tokens: Tensor, parents: Tensor, logits: Tensor, node_valid: Tensor, max_depth: int | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """`eyas.serve.verify.verify_greedy` with the walk down the tree in one launch (torch takes about ten kernels a
    tree level): the target's argmax [B, N] stays torch's, then one program per row walks its tree."""
    B, N = tokens.shape
    steps = N - 1 if max_depth is None else min(max_depth, N - 1)
    target = logits.argmax(-1)  # [B, N]
    accepted = torch.empty(B, N, dtype=torch.long, device=tokens.device)
    num_accepted, bonus = (torch.empty(B, dtype=torch.long, device=tokens.device) for _ in range(2))
    tokens, parents, node_valid = (x.contiguous() for x in (tokens, parents, node_valid))
    _greedy_walk_kernel[(B,)](tokens, parents, node_valid, target, accepted, num_accepted, bonus, N, STEPS=steps,
                              BLOCK=triton.next_power_of_2(N))
    return accepted, num_accepted, bonus


@jit
def _greedy_walk_kernel(tokens_ptr, parents_ptr, valid_ptr, target_ptr, accepted_ptr, num_ptr, bonus_ptr, N,
                        STEPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)  # node indices
    ok = j < N
    node = row * N + j
    parents = tl.load(parents_ptr + node, mask=ok, other=-1)
    after_parent = tl.load(target_ptr + row * N + tl.maximum(parents, 0), mask=ok, other=-1)
    valid = tl.load(valid_ptr + node, mask=ok, other=0) != 0
    # matches[j]: node j is exactly what the target emits after j's parent.
    matches = valid & (parents >= 0) & (tl.load(tokens_ptr + node, mask=ok, other=-1) == after_parent)
    accepted = tl.where(j == 0, 0, -1)
    cur = 0  # the last accepted node
    num = 0
    for depth in tl.static_range(1, STEPS + 1):
        child = tl.min(tl.where(matches & (parents == cur), j, BLOCK), 0)  # the first matching child (best ranked)
        found = child < BLOCK
        accepted = tl.where((j == depth) & found, child, accepted)
        cur = tl.where(found, child, cur)
        num += found.to(tl.int32)
    tl.store(accepted_ptr + node, accepted, mask=ok)
    tl.store(num_ptr + row, num)
    tl.store(bonus_ptr + row, tl.load(target_ptr + row * N + cur))


FUSED = Kernels(rms_norm=rms_norm, rotary=rotary, silu_mul=silu_mul)
