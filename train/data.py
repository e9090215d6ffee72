"""Real training data: a conversation file -> tokenized rows (`eyas.data`, cached) -> a held-out split, the draft
vocabulary and length-bucketed micro-batches.

    data = load_data(recipe.data, tokenizer, vocab_size=49152, draft_vocab_size=8192, seed=0)
    data.train[i]   # micro-batch i: {"input_ids", "loss_mask", "attention_mask"} [B, T] int64 (collate)
    data.eval       # the held-out rows, batched the same way
    data.hot        # the draft vocabulary: the most frequent assistant tokens of the training rows

The row order is a seeded shuffle; windows of `bucket` micro-batches are sorted by length before they are cut
into micro-batches (less padding), and the micro-batches are shuffled again. The same seed gives the same
batches, so a resumed run continues exactly where the interrupted one stopped.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.nn.functional as F
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from eyas.common.assets import ASSETS, asset_path
from eyas.common.hot_vocab import HotVocab
from eyas.data.dataset import build_dataset, collate
from eyas.data.vocab import draft_vocab, token_counts

from .batches import Batch
from .config import DataConfig


class Batches(Sequence):
    """Micro-batches of `rows`, one per index group, right-padded to a multiple of `pad_multiple`; collated on
    access, so skipping costs nothing."""

    def __init__(self, rows: Dataset, groups: list[list[int]], pad_multiple: int = 1):
        self.rows, self.groups, self.pad_multiple = rows, groups, pad_multiple

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> Batch:
        columns = self.rows[self.groups[i]]
        batch = collate([{"input_ids": ids, "loss_mask": mask}
                         for ids, mask in zip(columns["input_ids"], columns["loss_mask"], strict=True)])
        pad = -batch["input_ids"].shape[1] % self.pad_multiple
        return {k: F.pad(v, (0, pad)) for k, v in batch.items()}  # padding is masked out of attention and loss


@dataclass
class TrainData:
    train: Batches
    eval: Batches | None  # None: no rows held out
    hot: HotVocab


def resolve_data(spec: str) -> Path:
    """A conversation file given as a path or as the name of a packaged data set (`sharegpt`)."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if spec in ASSETS:
        return asset_path(spec)
    raise FileNotFoundError(f"data '{spec}' is neither an existing file nor a packaged data set ({sorted(ASSETS)})")


def length_groups(lengths: list[int], batch_size: int, bucket: int, rng: random.Random) -> list[list[int]]:
    """Row indices grouped into micro-batches of similar length, in a seeded random order."""
    order = rng.sample(range(len(lengths)), len(lengths))
    window = batch_size * bucket
    groups = []
    for start in range(0, len(order), window):
        rows = sorted(order[start : start + window], key=lambda i: lengths[i])
        groups += [rows[j : j + batch_size] for j in range(0, len(rows), batch_size)]
    rng.shuffle(groups)
    return groups


def load_data(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, vocab_size: int, draft_vocab_size: int, seed: int
) -> TrainData:
    rows = build_dataset(resolve_data(cfg.path), tokenizer, cfg, max_bytes=cfg.max_bytes)
    if cfg.max_conversations is not None:
        rows = rows.select(range(min(cfg.max_conversations, len(rows))))
    rng = random.Random(seed)
    order = rng.sample(range(len(rows)), len(rows))
    n_eval = round(cfg.eval_fraction * len(rows)) if cfg.eval_fraction else 0
    if n_eval >= len(rows):
        raise ValueError(f"{cfg.path}: {len(rows)} rows leave none for training after holding out {n_eval}")
    train_rows, eval_rows = rows.select(sorted(order[n_eval:])), rows.select(sorted(order[:n_eval]))

    def batches(part: Dataset) -> Batches:
        lengths = [len(ids) for b in part.select_columns("input_ids").iter(1000) for ids in b["input_ids"]]
        return Batches(part, length_groups(lengths, cfg.batch_size, cfg.bucket, rng), cfg.pad_multiple)

    hot = draft_vocab(token_counts(train_rows, vocab_size), draft_vocab_size)
    return TrainData(batches(train_rows), batches(eval_rows) if n_eval else None, hot)
