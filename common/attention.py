"""Attention metadata: how a layer's new queries, keys and values become its attention output.

The model never branches on training vs. serving: it hands q/k/v to the metadata object it was
given. In training the target's pass takes `CausalAttention`, and the head's unrolled passes (training-time test)
`TTTAttention` (`eyas.train.ttt`); serving passes a KV-cache backend (in `eyas.serve`), which stores k/v in cache
slots and attends under a tree mask. Tests pass `MaskedAttention`.

Shapes everywhere: q [B, T, Hq, D], k and v [B, T, Hkv, D] for the T new tokens of each of B rows;
the result is [B, T, Hq, D]. Hq is a multiple of Hkv (grouped-query attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionMetadata:
    """Interface: `attend(layer, q, k, v)` returns the attention output of layer `layer`."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        raise NotImplementedError

    def attend_rotary(self, layer: int, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                      rotary) -> Tensor:
        """`attend` on q and k rotated by `rotary(q, k, cos, sin)` (the layer's `Kernels.rotary`). A backend that
        stores k/v in a cache may rotate and store in one kernel instead."""
        q, k = rotary(q, k, cos, sin)
        return self.attend(layer, q, k, v)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
    """Scaled dot-product attention on [B, T, H, D] layouts; `mask` [B, T, S] bool (True = may attend)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=None if mask is None else mask[:, None],
        is_causal=causal,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


class CausalAttention(AttentionMetadata):
    """Plain causal self-attention over the given tokens, no cache (training, and parity tests)."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa(q, k, v, causal=True)


class MaskedAttention(AttentionMetadata):
    """Self-attention over the given tokens under an explicit mask [B, T, T] (True = may attend)."""

    def __init__(self, mask: Tensor):
        self.mask = mask

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa(q, k, v, mask=self.mask)


def causal_mask(n: int, device: torch.device | str | None = None) -> Tensor:
    """[n, n] lower-triangular bool mask."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()
