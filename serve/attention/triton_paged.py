"""A Triton backend: attention read straight from the paged cache through the block table.

One program handles one tile of packed query rows of one batch row and one kv head, so each K/V tile is
loaded once for the whole GQA group. Rows pack (query, head): row r of batch row b, kv head h is query
t = r // G, query head h * G + r % G (G = Hq / Hkv). Example, Llama-3.1-8B decode (T = 1, G = 4): one
16-row tile holds the 4 query heads (12 rows are padding; tl.dot needs 16); verification (T = 48) packs
192 rows into three 64-row tiles.

Each program walks its keys in BLOCK_N tiles with an online softmax (fp32): first the prefix (every query
sees it all), then the W window keys under window_mask, skipping window tiles no query of the tile sees
(above the diagonal of a causal prefill). A key at position p lives in slot
block_table[b, p // block_size] * block_size + p % block_size.

Split-KV (flash-decoding): when B * Hkv * tiles is too few programs to fill the GPU (batch-1 decode), the
prefix is cut into num_splits chunks, each program writes its normalised partial output and its
log-sum-exp, and a second kernel merges them. The chunk length is computed in the kernel from
prefix_lens, so nothing on the host reads lengths: launches are CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import kernels
from ..kernels import follow, launch_options
from .paged import PagedAttention

# Running-max start: finite, so a row that has seen no key yet updates as exp2(-inf - m) = 0 without NaN.
_NO_MAX: tl.constexpr = tl.constexpr(-1e30)


def available(device: torch.device) -> bool:
    """Whether the kernels can launch on `device`: a CUDA device, or Triton's CPU interpreter (TRITON_INTERPRET=1).
    (Importing this module already needs triton.)"""
    return device.type == "cuda" or kernels.INTERPRETED


class TritonPagedAttention(PagedAttention):
    """One forward's view (see `paged.py`), attended by a Triton kernel that reads the paged cache in place.

    `num_splits` forces the split-KV factor (tests); None chooses it from static shapes (`launch_config`).
    """

    graph_safe = True

    def __init__(self, pool, block_table: Tensor, prefix_lens: Tensor, window_mask: Tensor,
                 new_slots: Tensor | None = None, num_splits: int | None = None):
        super().__init__(pool, block_table, prefix_lens, window_mask, new_slots)
        self.num_splits = num_splits

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """As the base class's, in one launch for both (indexed assignment is one kernel each)."""
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        store_kv(k_cache, v_cache, self.new_slots, k, v)
        return k_cache, v_cache

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache, v_cache = self.write(layer, k, v)
        return self._attend_cached(q, k_cache, v_cache)

    def attend_rotary(self, layer: int, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                      rotary) -> Tensor:
        """With the fused rotary installed, one kernel rotates q and k and stores k and v in the cache."""
        if rotary is not kernels.rotary:
            return super().attend_rotary(layer, q, k, v, cos, sin, rotary)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        q = kernels.rotary_store(q, k, v, cos, sin, self.new_slots, k_cache, v_cache)
        return self._attend_cached(q, k_cache, v_cache)

    def _attend_cached(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return paged_attention(q, k_cache, v_cache, self.block_table, self.prefix_lens, self.window_mask,
                               self.pool.block_size, self.num_splits)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, prefix_lens: Tensor,
                    window_mask: Tensor, block_size: int, num_splits: int | None = None) -> Tensor:
    """q [B, T, Hq, D]; k_cache / v_cache [num_slots, Hkv, D] (already holding the new tokens) -> [B, T, Hq, D].

    Rows of D must be contiguous; strides that are multiples of 16 elements (the pool's always are) let Triton
    vectorise and pipeline the K/V loads.
    """
    B, T, Hq, D = q.shape
    W = window_mask.shape[2]
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    assert Hq == group * Hkv and k_cache.dtype == v_cache.dtype == q.dtype
    assert D >= 16 and D & (D - 1) == 0, "head_dim must be a power of two >= 16 (tl.dot, unmasked loads)"
    assert q.stride(3) == k_cache.stride(2) == v_cache.stride(2) == 1 and block_table.stride(1) == 1
    block_m, block_n, splits, num_warps = launch_config(B, T * group, Hkv, block_table.shape[1] * block_size,
                                                        _num_sms(q.device))
    splits = num_splits or splits
    tiles = triton.cdiv(T * group, block_m)

    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    # With splits, programs write fp32 partials [splits, B, T, Hq, D] and log2-sum-exps [splits, B, T, Hq].
    partial = out if splits == 1 else torch.empty(splits, B, T, Hq, D, dtype=torch.float32, device=q.device)
    lse = out if splits == 1 else torch.empty(splits, B, T, Hq, dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(tiles, B * Hkv, splits)](
        q, k_cache, v_cache, block_table, prefix_lens, window_mask, partial, lse,
        *q.stride()[:3], *k_cache.stride()[:2], *v_cache.stride()[:2], block_table.stride(0),
        *window_mask.stride(),
        B, T, W, Hkv, splits, math.log2(math.e) / math.sqrt(D),
        GROUP=group, PAGE=block_size, HEAD_DIM=D, BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=3, **launch_options(q.device),
    )
    if splits > 1:  # one warp a row: its threads each hold all splits of their columns, so the sums over splits
        # stay in registers (compiled for sm_90: no shared memory, where 4 warps pass them through 2 KB of it): 2.9
        # against 6.1 µs at an 8B verification's 48 rows x 11 splits, 2.2 against 3.0 at a draft pass's 8 x 33
        # (docs/perf.md)
        _merge_splits_kernel[(B * T * Hq,)](
            partial, lse, out, B * T * Hq, splits,
            SPLITS_POW2=triton.next_power_of_2(splits), HEAD_DIM=D, num_warps=1, **launch_options(out.device),
        )
    return out


def store_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """k_cache[slots] = k and v_cache[slots] = v: caches [num_slots, Hkv, D] (contiguous), slots [B, T], k / v
    [B, T, Hkv, D] whose (Hkv, D) rows are contiguous (a view of a joint projection's output is fine).
    One program per token."""
    B, T, Hkv, D = k.shape
    k, v = (x if x.stride(3) == 1 and x.stride(2) == D else x.contiguous() for x in (k, v))
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots.shape == (B, T) and slots.stride(1) == 1
    _store_kv_kernel[(B * T,)](k, v, slots, k_cache, v_cache, T, *k.stride()[:2], *v.stride()[:2], slots.stride(0),
                               ROW=Hkv * D, BLOCK=triton.next_power_of_2(Hkv * D), **launch_options(k.device))


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, T, stride_kb, stride_kt, stride_vb,
                     stride_vt, stride_sb, ROW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    token = tl.program_id(0).to(tl.int64)
    b, t = token // T, token % T
    slot = tl.load(slots_ptr + b * stride_sb + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < ROW
    tl.store(k_cache_ptr + slot * ROW + i, tl.load(k_ptr + b * stride_kb + t * stride_kt + i, mask=ok), mask=ok)
    tl.store(v_cache_ptr + slot * ROW + i, tl.load(v_ptr + b * stride_vb + t * stride_vt + i, mask=ok), mask=ok)


def launch_config(B: int, rows: int, Hkv: int, max_keys: int, num_sms: int) -> tuple[int, int, int, int]:
    """Tile sizes and split-KV factor from static sizes only (never prefix_lens values).

    rows = T * G packed query rows per (batch row, kv head); max_keys = M * block_size, the block table's reach.
    -> (BLOCK_M, BLOCK_N, NUM_SPLITS, num_warps).
    """
    block_m = 128 if rows >= 1024 else min(64, max(16, triton.next_power_of_2(rows)))  # prefill : decode/verify
    block_n = 64
    programs = B * Hkv * triton.cdiv(rows, block_m)
    # Aim at ~2 programs per SM (decode is bandwidth-bound: more loads in flight), never more splits than
    # key tiles. On an H200 (132 SMs): batch-1 decode runs 8 kv heads x 33 splits; batch 64, 512 programs, 1.
    splits = max(1, min(2 * num_sms // programs, triton.cdiv(max_keys, block_n), 64))
    return block_m, block_n, splits, 8 if block_m == 128 else 4


@functools.cache
def _num_sms(device: torch.device) -> int:
    """SMs to fill; 0 off CUDA (the interpreter), where only a caller's num_splits splits."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, prefix_lens_ptr, window_mask_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qt, stride_qh, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_bt,
    stride_mb, stride_mt, stride_mw,
    B, T, W, HKV, num_splits, scale_log2,  # runtime ints: fewer compiled variants across CUDA-graph buckets
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    tile, bh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kv_head = bh // HKV, bh % HKV
    # This split's share of the prefix, in whole key tiles: [lo, hi). Read before the wait (`follow`: the prefix
    # lengths are written before the layers, the key store and the q/k/v projection between).
    prefix = tl.load(prefix_lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(prefix, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, prefix)
    follow(PDL)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # packed rows [BLOCK_M]
    t, head = r // GROUP, kv_head * GROUP + r % GROUP
    row_ok = t < T
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    table = block_table_ptr + b * stride_bt
    k_base = k_ptr + kv_head * stride_k_head
    v_base = v_ptr + kv_head * stride_v_head

    m_i = tl.full([BLOCK_M], _NO_MAX, tl.float32)  # running max of scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, pos, key_ok, row_ok[:, None] & key_ok[None, :], table,
                                     k_base, v_base, stride_k_slot, stride_v_slot, d, scale_log2,
                                     PAGE, DOT_PRECISION)

    # The window, by the last split (its prefix chunk is the shortest): key w is at position prefix + w.
    if split == num_splits - 1:
        for start in range(0, W, BLOCK_N):
            w = start + tl.arange(0, BLOCK_N)
            key_ok = w < W
            seen = tl.load(window_mask_ptr + b * stride_mb + t[:, None] * stride_mt + w[None, :] * stride_mw,
                           mask=row_ok[:, None] & key_ok[None, :], other=0) != 0  # [BLOCK_M, BLOCK_N]
            if tl.max(seen.to(tl.int32)) > 0:
                acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, prefix + w, key_ok, seen, table, k_base, v_base,
                                             stride_k_slot, stride_v_slot, d, scale_log2, PAGE,
                                             DOT_PRECISION)

    # A row that saw nothing has l_i = 0 and acc = 0: output 0 (and lse -inf, weight 0 in the merge).
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    row = ((split * B + b) * T + t) * (HKV * GROUP) + head  # into [splits, B, T, Hq]
    tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if num_splits > 1:
        tl.store(lse_ptr + row, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, pos, key_ok, seen, table, k_base, v_base, stride_k_slot, stride_v_slot, d,
                 scale_log2, PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update with the keys at positions pos [BLOCK_N] (loaded where key_ok), seen [BLOCK_M, BLOCK_N]."""
    block = tl.load(table + pos // PAGE, mask=key_ok, other=0).to(tl.int64)
    slot = block * PAGE + pos % PAGE  # [BLOCK_N]
    k = tl.load(k_base + slot[:, None] * stride_k_slot + d[None, :], mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(v_base + slot[:, None] * stride_v_slot + d[None, :], mask=key_ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, ROWS, num_splits, SPLITS_POW2: tl.constexpr,
                         HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    """One (b, t, head) row: out = sum_s 2^lse_s * partial_s / sum_s 2^lse_s."""
    follow(PDL)
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + s * ROWS + row, mask=s < num_splits, other=float("-inf"))  # [SPLITS_POW2]
    weight = tl.exp2(lse - tl.maximum(tl.max(lse, 0), _NO_MAX))  # 0 for splits that saw no key
    partial = tl.load(partial_ptr + (s[:, None] * ROWS + row) * HEAD_DIM + d[None, :],
                      mask=(s < num_splits)[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))
