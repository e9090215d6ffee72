"""Training batches: `{"input_ids", "loss_mask", "attention_mask"}`, each [B, T] int64.

The trainer reads them from a sequence (a list, or `train.data.Batches` over tokenized conversations);
`synthetic_batches` makes random ones for CI, whose draft vocabulary is their most frequent assistant tokens
(`hot_vocab_from_batches`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from eyas.common.hot_vocab import HotVocab

from .config import SyntheticData

Batch = dict[str, Tensor]


def synthetic_batches(cfg: SyntheticData, vocab_size: int) -> list[Batch]:
    """Random rows; the first `assistant_fraction` of each row is the prompt (loss_mask 0).

    Token ids follow a skewed distribution (squares of uniform draws), so the draft vocabulary has frequent
    tokens to pick, as real text does.
    """
    g = torch.Generator().manual_seed(cfg.seed)
    prompt = int(cfg.seq_len * (1 - cfg.assistant_fraction))
    batches = []
    for _ in range(cfg.num_batches):
        u = torch.rand(cfg.batch_size, cfg.seq_len, generator=g)
        input_ids = (u * u * vocab_size).long().clamp(max=vocab_size - 1)
        loss_mask = torch.ones_like(input_ids)
        loss_mask[:, :prompt] = 0
        batches.append({"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(input_ids)})
    return batches


def hot_vocab_from_batches(batches: Iterable[Batch], vocab_size: int, size: int) -> HotVocab:
    """The `size` most frequent assistant tokens (EAGLE-3 order: ascending id); ties and unseen ids as
    `HotVocab.from_counts` resolves them."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for batch in batches:
        ids = batch["input_ids"][(batch["loss_mask"] & batch["attention_mask"]).bool()]
        counts += torch.bincount(ids, minlength=vocab_size)
    return HotVocab.from_counts(counts, min(size, vocab_size))


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
