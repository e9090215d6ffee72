"""Paged KV cache: a pool of fixed-size blocks shared by all sequences, and the allocator that hands
them out. A sequence's keys live in the slots of its blocks (slot = block * block_size + offset).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .transfer import to_device


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for; the scheduler queues or preempts instead."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low block ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class KVPool:
    """Per-layer key and value storage, [num_slots, Hkv, D] each, with its block allocator. All layers' keys and
    values are views of one tensor [2, L, num_slots, Hkv, D], so `move` copies slots of every layer at once.

    One block beyond the allocator's, `scratch_block`, belongs to no request: the padding rows of a
    CUDA-graph batch bucket write their (ignored) k/v there."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.block_size = block_size
        self.scratch_block = num_blocks
        shape = ((num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.kv = torch.zeros((2, num_layers) + shape, dtype=dtype, device=device)
        self.k, self.v = list(self.kv[0].unbind()), list(self.kv[1].unbind())
        self._plane_rows = torch.arange(2 * num_layers, device=device)[:, None] * shape[0]  # [2·L, 1]: for `move`
        self.allocator = BlockAllocator(num_blocks)

    def rows_of(self, slots: Tensor) -> Tensor:
        """slots [n] -> [2·L·n], the rows of the pool's [2·L·slots, Hkv·D] view holding every layer's key and value
        at them, for `move`."""
        return (self._plane_rows + slots).flatten()

    def move(self, src_rows: Tensor, dst_rows: Tensor) -> None:
        """Copies rows `src_rows` to `dst_rows` (`rows_of`), all read before any is written, so a slot may be both a
        source and a destination. Destinations must be distinct but where several copies write alike (padding
        rows' copies into the scratch block). One gather and one scatter; no host sync."""
        rows = self.kv.view(-1, self.kv.shape[-2] * self.kv.shape[-1])  # [2·L·slots, Hkv·D]
        rows[dst_rows] = rows[src_rows]

    def block_table(self, rows: Sequence[Sequence[int]], device: torch.device | str | None = None,
                    width: int | None = None, padding_rows: int = 0) -> Tensor:
        """Each row's blocks (in position order) -> [B + padding_rows, W] int32, W the longest row's block count
        or `width` if that is more. Entries past a row's blocks are `scratch_block` (never read: past its
        lengths); so are padding rows."""
        longest = max(map(len, rows))
        table = torch.full((len(rows) + padding_rows, longest), self.scratch_block, dtype=torch.int32)
        # Built on the host as wide as the longest row and sent in one copy, then widened on the device (graphs
        # take full-width tables: 8192 columns at 8B's context). A boolean mask fills in row-major order.
        filled = torch.arange(longest) < torch.tensor([len(r) for r in rows])[:, None]  # [B, longest]
        table[: len(rows)][filled] = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int32)
        return F.pad(to_device(table, device), (0, max(width or 0, longest) - longest), value=self.scratch_block)
