"""The reference backend: gathers each row's keys from the paged cache and runs SDPA with an explicit
mask. Runs anywhere (CPU included); every GPU kernel is tested against it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from eyas.common.attention import sdpa

from .paged import PagedAttention, dense_view, seeing


class TorchPagedAttention(PagedAttention):
    """One forward's view (see `paged.py`), attended by gathering keys and running masked SDPA."""

    def __init__(self, pool, block_table: Tensor, prefix_lens: Tensor, window_mask: Tensor,
                 new_slots: Tensor | None = None):
        super().__init__(pool, block_table, prefix_lens, window_mask, new_slots)
        self.kv_slots, self.mask = dense_view(block_table, prefix_lens, window_mask, pool.block_size)
        self.sees_any = seeing(self.mask)  # the same for every layer, so computed once

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache, v_cache = self.write(layer, k, v)
        group = q.shape[2] // k.shape[2]
        keys = k_cache[self.kv_slots].repeat_interleave(group, dim=2)  # [B, S, Hq, D]
        values = v_cache[self.kv_slots].repeat_interleave(group, dim=2)
        # The key length changes every decode step: cuDNN would plan a new graph each call (~1.7 ms of host
        # time per call on an H200). The memory-efficient kernel takes arbitrary masks, without GQA, hence
        # the expanded heads.
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = sdpa(q, keys, values, mask=self.mask)
        return torch.where(self.sees_any, out, 0.0)
