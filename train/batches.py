"""Training batches: `{"input_ids", "loss_mask", "attention_mask"}`, each [B, T] int64, plus, in offline training,
the target's dumped states `aux` [B, T, 3·Ht] and `hidden` [B, T, Ht] (or `logits` [B, T, V]).

`Batches` collates them from rows (a tokenized data set, `synthetic_rows` for CI, or the dumped hidden states of
either) by groups of row indices; `micro_batches` deals them out to ranks in turn, epoch after epoch.
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
    """Endless (position, batch) pairs for this rank, from position `start` on.

    A position counts this rank's micro-batches. The ranks deal the batches out in turn, epoch after epoch with no
    break between them: at position p, rank r takes batch (p·world_size + r) mod len(batches). So every rank takes
    one at each position and every batch is trained on once an epoch, however many ranks share them: with 10 batches
    over 4 ranks, positions 0 and 1 take batches 0-7, position 2 batches 8, 9 and the next epoch's 0, 1. (Ranks each
    cycling through a share of their own would not: ranks 0-1 holding 3 batches and ranks 2-3 two, the latter's
    would be trained on 3 times for every 2 of the former's.) Positions map to batches directly, so a resumed run
    continues on exactly the batches the interrupted one would have seen next without reading the ones before.
    """
    for position in itertools.count(start):
        yield position, batches[(position * world_size + rank) % len(batches)]
