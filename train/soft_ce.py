"""The TTT loss's soft-label cross-entropy on CUDA: one Triton pass over a row's logits forward, one backward.

For a row of draft logits x [V] and its labels' logits t [V] (the target's, over the draft columns) with their
logsumexp u: the labels p = exp(t - u), the loss lse(x) - Σ_v p_v·x_v, its gradient softmax(x) - p, and the argmax
of x (the accuracy's draft token). Forward reads x and t once (online logsumexp, Σ p·x and the argmax in one loop),
keeping lse(x) a row for backward, which reads them once more and writes the gradient. Nothing [rows, V] is written
but the gradient: the labels are formed where they are read, in fp32 from bf16 logits.

What it replaced, compiled torch (`torch.compile` of the same formula over fp32 labels), took 4.5 ms a backward and
2 ms a forward at 16 rows of 2,048 tokens over 32,000 columns on an H200, 46 of a 228 ms training step; with these
kernels that step takes 205 ms against 231 (docs/perf.md, twenty-eighth and twenty-ninth entries).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_MAX = 4096  # columns a program holds per loop (32,000 columns: 8 loops)


@triton.jit
def _forward_kernel(x_ptr, t_ptr, u_ptr, loss_ptr, lse_ptr, top_ptr, N, V,
                    stride_xb, stride_xn, stride_tb, stride_tn, stride_ub, stride_un,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * N + n; int64: rows x V passes 2^31 at 64k rows of 32k columns
    b, n = row // N, row % N
    x_row = x_ptr + b * stride_xb + n * stride_xn
    t_row = t_ptr + b * stride_tb + n * stride_tn
    u = tl.load(u_ptr + b * stride_ub + n * stride_un)
    cols = tl.arange(0, BLOCK)
    # The row's running max over the loops so far (finite: a loop of masked -inf never forms inf - inf); per lane
    # Σ exp(x - peak), Σ p·x, and the largest x with its first column (lanes see their columns in increasing order).
    # One max over the block a loop keeps the exps to two an element (the sum's and the label's).
    peak = -1e30
    total = tl.zeros([BLOCK], tl.float32)
    dot = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        col = start + cols
        ok = col < V
        x = tl.load(x_row + col, mask=ok, other=float("-inf")).to(tl.float32)
        t = tl.load(t_row + col, mask=ok, other=float("-inf")).to(tl.float32)
        new_peak = tl.maximum(peak, tl.max(x, 0))
        total = total * tl.exp(peak - new_peak) + tl.exp(x - new_peak)
        peak = new_peak
        dot += tl.where(ok, tl.exp(t - u) * x, 0.0)
        better = x > best
        best_col = tl.where(better, col, best_col)
        best = tl.where(better, x, best)
    lse = peak + tl.log(tl.sum(total, 0))
    tl.store(loss_ptr + row, lse - tl.sum(dot, 0))
    tl.store(lse_ptr + row, lse)
    top = tl.max(best, 0)
    tl.store(top_ptr + row, tl.min(tl.where(best == top, best_col, V), 0).to(tl.int64))  # torch's: the first


@triton.jit
def _backward_kernel(x_ptr, t_ptr, u_ptr, lse_ptr, grad_loss_ptr, grad_ptr, N, V,
                     stride_xb, stride_xn, stride_tb, stride_tn, stride_ub, stride_un, stride_gb, stride_gn,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, n = row // N, row % N
    x_row = x_ptr + b * stride_xb + n * stride_xn
    t_row = t_ptr + b * stride_tb + n * stride_tn
    u = tl.load(u_ptr + b * stride_ub + n * stride_un)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(grad_loss_ptr + b * stride_gb + n * stride_gn)
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        col = start + cols
        ok = col < V
        x = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
        t = tl.load(t_row + col, mask=ok, other=0.0).to(tl.float32)
        grad = scale * (tl.exp(x - lse) - tl.exp(t - u))
        tl.store(grad_ptr + row * V + col, grad.to(grad_ptr.dtype.element_ty), mask=ok)


def _block(V: int) -> int:
    return min(BLOCK_MAX, triton.next_power_of_2(V))


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, label_logits: Tensor, label_lse: Tensor):
        B, N, V = logits.shape
        logits, label_logits = (a if a.stride(-1) == 1 else a.contiguous() for a in (logits, label_logits))
        loss = torch.empty(B, N, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(loss)
        top = torch.empty(B, N, dtype=torch.int64, device=logits.device)
        if B * N:
            _forward_kernel[(B * N,)](
                logits, label_logits, label_lse, loss, lse, top, N, V, logits.stride(0), logits.stride(1),
                label_logits.stride(0), label_logits.stride(1), label_lse.stride(0), label_lse.stride(1),
                BLOCK=_block(V), num_warps=8)
        ctx.save_for_backward(logits, label_logits, label_lse, lse)
        ctx.mark_non_differentiable(top)
        return loss, top

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_top):
        logits, label_logits, label_lse, lse = ctx.saved_tensors
        B, N, V = logits.shape
        grad = torch.empty(B, N, V, dtype=logits.dtype, device=logits.device)
        if B * N:
            _backward_kernel[(B * N,)](
                logits, label_logits, label_lse, lse, grad_loss, grad, N, V, logits.stride(0), logits.stride(1),
                label_logits.stride(0), label_logits.stride(1), label_lse.stride(0), label_lse.stride(1),
                grad_loss.stride(0), grad_loss.stride(1), BLOCK=_block(V), num_warps=8)
        return grad, None, None


def soft_cross_entropy_kernel(logits: Tensor, label_logits: Tensor, label_lse: Tensor) -> tuple[Tensor, Tensor]:
    """`ttt.soft_cross_entropy` in the kernels above: logits, label_logits [B, N, V] (any float dtype, any strides
    but the last's), label_lse [B, N] fp32 -> (loss [B, N] fp32, differentiable in logits; argmax [B, N] int64)."""
    return _SoftCrossEntropy.apply(logits, label_logits, label_lse)
