"""The reference backend: gathers each row's keys from the paged cache and runs SDPA with an explicit
mask. Runs anywhere (CPU included); every GPU kernel is tested against it.
"""

from __future__ import annotations

from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from eyas.common.attention import AttentionMetadata, sdpa

from ..kv_cache import KVPool


class TorchPagedAttention(AttentionMetadata):
    """One forward's metadata.

    new_slots [B, T]: where each new token's k/v is written.
    kv_slots  [B, S]: the slots each row attends over, new tokens included (padding: any valid slot).
    mask   [B, T, S]: True where new token t of row b may attend key s (causal prefix, tree ancestry).
    """

    def __init__(self, pool: KVPool, new_slots: Tensor, kv_slots: Tensor, mask: Tensor):
        self.pool, self.new_slots, self.kv_slots, self.mask = pool, new_slots, kv_slots, mask

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        k_cache[self.new_slots] = k
        v_cache[self.new_slots] = v
        group = q.shape[2] // k.shape[2]
        keys = k_cache[self.kv_slots].repeat_interleave(group, dim=2)  # [B, S, Hq, D]
        values = v_cache[self.kv_slots].repeat_interleave(group, dim=2)
        # The key length changes every decode step: cuDNN would plan a new graph each call (~1.7 ms of host
        # time per call on an H200). The memory-efficient kernel takes arbitrary masks, without GQA, hence
        # the expanded heads.
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return sdpa(q, keys, values, mask=self.mask)
