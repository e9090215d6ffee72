"""Rotary tables looked up, not computed: the cos/sin of every position a decode step can reach, built once.

`Rotary` computes a pass's tables from its positions in seven launches (a cast, the product, a cat, cos, sin and
two casts); a decode step needs them in each of its graphs (the draft tree, verification, the draft's extension),
where launches, not bytes, bound a small model's step. A `RopeTable` holds what `Rotary` gives for positions 0 ..
P-1, in the model's dtype, and a lookup is one gather. The values are `Rotary`'s own, so a lookup equals computing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from eyas.common.layers import Rotary


class RopeTable:
    """`Rotary`'s tables for positions 0 .. positions-1: [positions, 2·D] (cos, then sin), e.g. 64 MB for
    Llama-3.1-8B's 131,072 positions in bf16."""

    def __init__(self, rotary: Rotary, positions: int, dtype: torch.dtype):
        cos, sin = rotary(torch.arange(positions, device=rotary.inv_freq.device)[None], dtype)  # [1, P, D] each
        self.table = torch.cat([cos[0], sin[0]], dim=-1)  # [P, 2·D]

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [...] int, each in [0, P) -> cos, sin [..., D] (views of one gathered tensor)."""
        return F.embedding(positions, self.table).chunk(2, dim=-1)


def rope_tables(rotaries: list[Rotary], positions: int, dtype: torch.dtype) -> list[RopeTable]:
    """One table per rotary, shared between rotaries of the same settings (a head shaped like its target's layers
    rotates as the target does)."""
    tables: dict[tuple, RopeTable] = {}
    for r in rotaries:
        if (r.rope, r.head_dim) not in tables:
            tables[r.rope, r.head_dim] = RopeTable(r, positions, dtype)
    return [tables[r.rope, r.head_dim] for r in rotaries]
