"""What every paged-KV backend is given: one forward's view of the cache, as a prefix and a window.

Every attention the engine runs has the same form. Row b of the batch sees
  - its prefix: every cached key at positions 0 .. prefix_lens[b] - 1, and
  - a window of W keys right after it, position prefix_lens[b] + w, each under an explicit mask,
and its T new tokens are the window's last T: token t's k/v are written at position
prefix_lens[b] + W - T + t before anyone attends. A chunked prefill is a causal window (W = T); a tree
verification is the tree's ancestor mask (W = T = nodes); a draft pass on a tree's frontier sees the
nodes drafted so far (W = drafted, T = topk).

Padding (batch buckets of CUDA graphs, ragged rows) is expressed in the same terms: a padding query has
an all-False window row and no prefix, and its output is zero; its k/v land in its row's blocks (the
engine points padding rows at the pool's scratch block).

Shapes: q [B, T, Hq, D], k / v [B, T, Hkv, D]; block_table [B, M] int32, the row's blocks in position
order (entries past its last block: any valid block); prefix_lens [B] int32; window_mask [B, T, W] bool.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.common.attention import AttentionMetadata

from ..kv_cache import KVPool


class PagedAttention(AttentionMetadata):
    """Base of the backends: holds the view, writes the new tokens' k/v; subclasses implement `attend`."""

    graph_safe = False  # whether a forward through it can be captured in a CUDA graph (no host syncs)

    def __init__(self, pool: KVPool, block_table: Tensor, prefix_lens: Tensor, window_mask: Tensor,
                 new_slots: Tensor | None = None):
        """`new_slots` [B, T]: the new tokens' cache slots, where the caller has looked them up already (the
        draft's passes over one tree slice them from one lookup); None: looked up here."""
        # int32 like the block table: kernels index with them (and mixing int widths breaks Triton's typing).
        prefix_lens = prefix_lens.to(torch.int32)
        self.pool, self.block_table, self.prefix_lens, self.window_mask = pool, block_table, prefix_lens, window_mask
        if new_slots is None:
            B, T, W = window_mask.shape
            positions = prefix_lens[:, None].long() + (W - T) + torch.arange(T, device=window_mask.device)  # [B, T]
            new_slots = slots_of(block_table, positions, pool.block_size)
        self.new_slots = new_slots

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Stores the new tokens' k/v in layer `layer`'s cache; returns that layer's (k_cache, v_cache)."""
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        k_cache[self.new_slots] = k
        v_cache[self.new_slots] = v
        return k_cache, v_cache


def slots_of(block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """block_table [B, M], positions [B, T] -> cache slots [B, T] (slot = block * block_size + offset)."""
    blocks = block_table.long().gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def dense_mask(prefix_lens: Tensor, window_mask: Tensor) -> Tensor:
    """The view's mask over explicit keys -> [B, T, S] with S = max(prefix) + W: key s of row b is position s when
    s < prefix_lens[b], window key s - prefix_lens[b] when that is in [0, W), else masked. Reads max(prefix_lens)
    on the host, so it is not for CUDA graphs."""
    B, T, W = window_mask.shape
    S = int(prefix_lens.max()) + W
    positions = torch.arange(S, device=window_mask.device).expand(B, S)
    prefix = prefix_lens[:, None].long()
    in_window = (positions >= prefix) & (positions < prefix + W)
    window_index = (positions - prefix).clamp(0, W - 1)  # [B, S]
    return torch.where(
        in_window[:, None],
        window_mask.gather(2, window_index[:, None].expand(B, T, S)),
        (positions < prefix)[:, None].expand(B, T, S),
    )


def dense_view(block_table: Tensor, prefix_lens: Tensor, window_mask: Tensor, block_size: int):
    """The view as explicit key slots and a mask over them, for gather-based attention: -> slots [B, S] (the
    cache slot of each key of `dense_mask`, 0 past a row's keys) and mask [B, T, S]."""
    mask = dense_mask(prefix_lens, window_mask)
    B, S = mask.shape[0], mask.shape[-1]
    positions = torch.arange(S, device=mask.device).expand(B, S)
    valid = positions < prefix_lens[:, None].long() + window_mask.shape[-1]
    slots = torch.where(valid, slots_of(block_table, positions.clamp(max=block_table.shape[1] * block_size - 1),
                                        block_size), 0)
    return slots, mask


def seeing(mask: Tensor) -> Tensor:
    """mask [B, T, S] -> [B, T, 1, 1]: the queries that see some key. A query that sees none (padding) gets NaN from
    a softmax over nothing; the backends zero its output, as the Triton kernels do."""
    return mask.any(-1)[:, :, None, None]
