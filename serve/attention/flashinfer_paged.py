"""The FlashInfer backend: FlashInfer's batch prefill kernel over the paged cache in place, under a custom mask.

Every view (`paged.py`) is one call: row b's queries attend to its keys at positions 0 .. prefix + W - 1 (the
cache's pages, read in place) under the mask FlashInfer takes flattened per row, [T, prefix + W]: the prefix
visible, the window as `window_mask` says. Plain decode, tree verification, draft passes and prefill chunks all
take this one path. Planning (page lists, the packed mask) reads lengths on the host, once per forward; the
plan serves every layer. So no CUDA graphs: the engine runs it eagerly (`graph_safe` False).

Used with `--attention flashinfer` when `flashinfer-python` is installed (CUDA, fp16/bf16 caches).
"""

from __future__ import annotations

import weakref

import flashinfer
import torch
from torch import Tensor

from ..kv_cache import KVPool
from .paged import PagedAttention, dense_mask, seeing

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results)

# One wrapper per pool: it owns pinned host and device workspaces (costly to allocate per forward), and a
# forward's plan is used before the next forward plans again (the engine runs one forward at a time).
_wrappers: weakref.WeakKeyDictionary[KVPool, flashinfer.BatchPrefillWithPagedKVCacheWrapper] = (
    weakref.WeakKeyDictionary())


def _wrapper(pool: KVPool) -> flashinfer.BatchPrefillWithPagedKVCacheWrapper:
    if pool not in _wrappers:
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.kv.device)
        _wrappers[pool] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    return _wrappers[pool]


class FlashInferPagedAttention(PagedAttention):
    """One forward's view, attended by FlashInfer's paged prefill with a custom mask; planned at the first layer."""

    def __init__(self, pool: KVPool, block_table: Tensor, prefix_lens: Tensor, window_mask: Tensor,
                 new_slots: Tensor | None = None):
        super().__init__(pool, block_table, prefix_lens, window_mask, new_slots)
        B, T, W = window_mask.shape
        bs = pool.block_size
        kv_lens = prefix_lens.long() + W  # [B] keys per row
        pages = (kv_lens + bs - 1) // bs  # [B]
        # Row b's pages are its first pages[b] blocks; its mask is dense_mask's, cut to its own keys.
        mask = dense_mask(prefix_lens, window_mask)  # [B, T, S], S = max(prefix) + W
        S = mask.shape[-1]
        own = torch.arange(S, device=mask.device)[None] < kv_lens[:, None]  # [B, S]
        listed = torch.arange(block_table.shape[1], device=mask.device)[None] < pages[:, None]  # [B, M]
        self.plan_args = dict(
            qo_indptr=torch.arange(0, B * T + 1, T, dtype=torch.int32, device=mask.device),
            paged_kv_indptr=torch.nn.functional.pad(pages.cumsum(0), (1, 0)).int(),
            paged_kv_indices=block_table[listed].int(),
            paged_kv_last_page_len=(kv_lens - (pages - 1) * bs).int(),
            custom_mask=mask[own[:, None, :].expand(B, T, S)],  # row-major per row: [T, prefix + W] each
        )
        self.sees_any = seeing(mask)
        self.planned = False

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache, v_cache = self.write(layer, k, v)  # [slots, Hkv, D] each
        B, T, Hq, D = q.shape
        wrapper = _wrapper(self.pool)
        if not self.planned:
            wrapper.plan(**self.plan_args, num_qo_heads=Hq, num_kv_heads=k.shape[2], head_dim_qk=D,
                         page_size=self.pool.block_size, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
            self.planned = True
        pages = (k_cache.view(-1, self.pool.block_size, *k_cache.shape[1:]),
                 v_cache.view(-1, self.pool.block_size, *v_cache.shape[1:]))  # [blocks, block_size, Hkv, D]
        out = wrapper.run(q.reshape(B * T, Hq, D), pages).view(B, T, Hq, D)
        return torch.where(self.sees_any, out, 0.0)
