"""Training batches: `{"input_ids", "loss_mask", "attention_mask"}`, each [B, T] int64.

Until `eyas.data` provides tokenized conversations, the trainer takes any re-iterable of such batches
(a list, a DataLoader); `synthetic_batches` makes random ones for CI. The draft vocabulary is the most
frequent assistant tokens of the data (`hot_vocab_from_batches`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

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


def micro_batches(batches: Iterable[Batch], start: int, rank: int, world_size: int) -> Iterator[tuple[int, Batch]]:
    """Endless (position, batch) pairs for this rank, epoch after epoch, skipping the first `start` positions.

    A position counts this rank's micro-batches; batch j of an epoch goes to rank j % world_size. Skipping by
    iterating keeps a resumed run on exactly the batches the interrupted one would have seen next.
    """
    position = 0
    while True:
        seen = False
        for j, batch in enumerate(batches):
            if j % world_size != rank:
                continue
            seen = True
            if position >= start:
                yield position, batch
            position += 1
        if not seen:
            raise ValueError(f"no training batches for rank {rank} of {world_size}")
