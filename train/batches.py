"""Training batches: `{"input_ids", "loss_mask", "attention_mask"}`, each [B, T] int64, plus, in offline training,
the target's dumped states `aux` [B, T, 3·Ht] and `hidden` [B, T, Ht] (or `logits` [B, T, V]).

`Batches` collates them from rows (a tokenized data set, `synthetic_rows` for CI, or the dumped hidden states of
either) by groups of row indices; `micro_batches` deals them out to ranks, epoch after epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch
from datasets import Dataset
from torch import Tensor

from eyas.data.hidden_states import collate_hidden_states

from .config import SyntheticData

Batch = dict[str, Tensor]


class Batches(Sequence):
    """Micro-batches of `rows` (row i: a dict of `input_ids`, `loss_mask` [T] and any per-token states [T, ...]),
    one per group of row indices, right-padded to a multiple of `pad_multiple`; collated on access, so skipping
    costs nothing."""

    def __init__(self, rows: Sequence[dict], groups: list[list[int]], pad_multiple: int = 1):
        self.rows, self.groups, self.pad_multiple = rows, groups, pad_multiple

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def micro_batch_size(self) -> int:
        """The most rows a micro-batch holds (groups are shuffled, and one may be short)."""
        return max(map(len, self.groups))

    def __getitem__(self, i: int) -> Batch:
        return collate_hidden_states([self.rows[j] for j in self.groups[i]], self.pad_multiple)


def synthetic_rows(cfg: SyntheticData, vocab_size: int) -> Dataset:
    """`num_batches · batch_size` random rows of `seq_len` tokens; the first `1 - assistant_fraction` of each row is
    the prompt (loss_mask 0). Batched in order, `batch_size` at a time.

    Token ids follow a skewed distribution (squares of uniform draws), so the draft vocabulary has frequent
    tokens to pick, as real text does.
    """
    g = torch.Generator().manual_seed(cfg.seed)
    prompt = int(cfg.seq_len * (1 - cfg.assistant_fraction))
    input_ids = []
    for _ in range(cfg.num_batches):
        u = torch.rand(cfg.batch_size, cfg.seq_len, generator=g)
        input_ids += (u * u * vocab_size).long().clamp(max=vocab_size - 1).tolist()
    loss_mask = [[0] * prompt + [1] * (cfg.seq_len - prompt)] * len(input_ids)
    return Dataset.from_dict({"input_ids": input_ids, "loss_mask": loss_mask})


def micro_batches(batches: Sequence[Batch], start: int, rank: int, world_size: int) -> Iterator[tuple[int, Batch]]:
    """Endless (position, batch) pairs for this rank, epoch after epoch, from position `start` on.

    A position counts this rank's micro-batches; batch j of an epoch goes to rank j % world_size. Positions map
    to batches directly, so a resumed run continues on exactly the batches the interrupted one would have seen
    next without reading the ones before.
    """
    mine = range(rank, len(batches), world_size)
    if not mine:
        raise ValueError(f"no training batches for rank {rank} of {world_size}")
    for position in itertools.count(start):
        yield position, batches[mine[position % len(mine)]]
