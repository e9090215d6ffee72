"""The accept phase's bookkeeping around the draft's extension: what the draft reads along each row's accepted path
(`path_inputs`), and the move of the path's target KV to the positions its nodes now hold (`move_path`).

Torch references here. On CUDA the engine runs `eyas.serve.step_kernels.ACCEPT`, which equals them in one launch each
where these take about twenty and two small kernels: a small model's accept phase is bound by its launches.

Shapes: B' rows (padding rows included), N tree nodes, T the path length a step provides for (its tree's depth + 1,
at most N); path [B', N] node indices (accepted, then -1; node 0 is the root); num_accepted, bonus, n [B'] int64;
tokens [B', N]; table [B', M] int32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from eyas.common.target import TargetOutput

from .attention.paged import slots_of
from .kv_cache import KVPool
from .tree import gather_rows


class PathInputs(NamedTuple):
    """The draft's inputs at draft positions n .. n+T-1 of each row (columns past num_accepted are padding)."""

    next_tokens: Tensor  # [B', T] the token after each path node: the next node's, the bonus after the last
    positions: Tensor  # [B', T] int64, n + t
    slots: Tensor  # [B', T] int64, their cache slots
    states: TargetOutput  # the target's hidden [B', T, H] and aux [B', T, A] (or None) at the path's nodes


def path_inputs(path: Tensor, num_accepted: Tensor, bonus: Tensor, tokens: Tensor, hidden: Tensor,
                aux: Tensor | None, n: Tensor, table: Tensor, block_size: int, T: int) -> PathInputs:
    """Column t of a row reads its path's node t (node 0 past the path's end); hidden [B', N, H], aux [B', N, A]."""
    nodes = path[:, :T].clamp(min=0)  # [B', T]
    after = torch.cat([tokens.gather(1, nodes[:, 1:]), bonus[:, None]], dim=1)  # [B', T]
    is_last = torch.arange(T, device=path.device)[None] == num_accepted[:, None]
    positions = n[:, None] + torch.arange(T, device=path.device)
    states = TargetOutput(hidden=gather_rows(hidden, nodes), aux=None if aux is None else gather_rows(aux, nodes))
    return PathInputs(torch.where(is_last, bonus[:, None], after), positions, slots_of(table, positions, block_size),
                      states)


def move_path(pool: KVPool, path: Tensor, num_accepted: Tensor, n: Tensor, table: Tensor, T: int) -> None:
    """Each row's accepted node path[b, t] (t = 1 .. num_accepted[b]) moves its target KV, every layer's, from
    position n + path[b, t] to n + t; the other columns copy a slot onto itself. Not idempotent (a node's new slot
    may be another's old one), so never inside a CUDA graph, whose first call runs thrice."""
    j = torch.arange(T, device=path.device)
    source = torch.where(j <= num_accepted[:, None], path[:, :T].clamp(min=0), j)  # [B', T]
    src, dst = (slots_of(table, n[:, None] + x, pool.block_size).flatten() for x in (source, j[None]))
    pool.move(pool.rows_of(src), pool.rows_of(dst))


class AcceptKernels(NamedTuple):
    """The torch references above (`TORCH_ACCEPT`), or the Triton kernels that equal them (`step_kernels.ACCEPT`)."""

    path_inputs: Callable[..., PathInputs]
    move_path: Callable[..., None]


TORCH_ACCEPT = AcceptKernels(path_inputs, move_path)
