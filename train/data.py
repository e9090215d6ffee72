"""Training data: the recipe's rows (a conversation file tokenized by `eyas.data`, cached, or synthetic rows) -> a
held-out split, the draft vocabulary and length-bucketed micro-batches, read from the rows themselves or, offline,
from the target's hidden states dumped for them.

    rows = load_rows(recipe, vocab_size=49152)
    data = load_data(recipe.data, rows, vocab_size=49152, draft_vocab_size=8192, seed=0)
    data.train[i]   # micro-batch i: {"input_ids", "loss_mask", "attention_mask"} [B, T] int64 (batches.Batches)
    data.eval       # the held-out rows, batched the same way
    data.hot        # the draft vocabulary: the most frequent assistant tokens of the training rows

The row order is a seeded shuffle; windows of `bucket` micro-batches are sorted by length before they are cut
into micro-batches (less padding), and the micro-batches are shuffled again. The same seed gives the same
batches, so a resumed run continues exactly where the interrupted one stopped. Synthetic rows are batched in
order, all of them for training. Offline (`states`), the same micro-batches are collated from the dumped rows,
which carry the target's states besides the tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from datasets import Dataset

from eyas.common.assets import resolve_asset, resolve_target
from eyas.common.hot_vocab import HotVocab
from eyas.data.dataset import build_dataset
from eyas.data.hidden_states import HiddenStateDataset
from eyas.data.tokenizer import load_tokenizer
from eyas.data.vocab import draft_vocab, token_counts

from .batches import Batches, synthetic_rows
from .config import DataConfig, TrainRecipe


@dataclass
class TrainData:
    train: Batches
    eval: Batches | None  # None: no rows held out
    hot: HotVocab


def load_rows(recipe: TrainRecipe, vocab_size: int) -> Dataset:
    """The recipe's rows, columns `input_ids` and `loss_mask` (int lists): `data.path` in the chat template of
    `data.tokenizer` (default: the target's), at most `data.max_conversations` of them, or `data.synthetic`.
    What training batches and what `train-eagle --dump-hidden-states` runs the target over, row i for row i."""
    cfg = recipe.data
    if cfg.synthetic is not None:
        return synthetic_rows(cfg.synthetic, vocab_size)
    if cfg.path is None:
        raise ValueError("no training data: set data.path or data.synthetic in the recipe")
    source = cfg.tokenizer or recipe.model.target
    if source is None:
        raise ValueError("data.path with a random target needs data.tokenizer (a target whose tokenizer to use)")
    rows = build_dataset(resolve_asset(cfg.path), load_tokenizer(resolve_target(source)), cfg)
    if cfg.max_conversations is not None:
        rows = rows.select(range(min(cfg.max_conversations, len(rows))))
    return rows


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
    cfg: DataConfig, rows: Dataset, vocab_size: int, draft_vocab_size: int, seed: int,
    states: HiddenStateDataset | None = None,
) -> TrainData:
    """Splits and batches `rows` (`load_rows`); with `states` (the target's hidden states dumped for these rows,
    checked to hold as many rows of the same lengths), the micro-batches are collated from them instead."""
    lengths = [len(ids) for b in rows.select_columns("input_ids").iter(1000) for ids in b["input_ids"]]
    if states is not None and states.lengths != lengths:
        if states.lengths == lengths[: len(states)]:
            raise ValueError(f"{states.path}: holds the first {len(states)} of the recipe's {len(rows)} rows; finish "
                             "the dump (rerun train-eagle --dump-hidden-states: it resumes)")
        raise ValueError(f"{states.path}: dumped from other data (its {len(states)} rows differ in number or length "
                         f"from the recipe's {len(rows)}); dump this recipe's into another directory")
    source = rows if states is None else states

    if cfg.synthetic is not None:
        size = cfg.synthetic.batch_size
        groups = [list(range(i, i + size)) for i in range(0, len(rows), size)]  # synthetic_rows' batches
        return TrainData(Batches(source, groups, cfg.pad_multiple), None,
                         draft_vocab(token_counts(rows, vocab_size), draft_vocab_size))

    rng = random.Random(seed)
    order = rng.sample(range(len(rows)), len(rows))
    n_eval = round(cfg.eval_fraction * len(rows)) if cfg.eval_fraction else 0
    if n_eval >= len(rows):
        raise ValueError(f"{cfg.path}: {len(rows)} rows leave none for training after holding out {n_eval}")
    train_rows, eval_rows = sorted(order[n_eval:]), sorted(order[:n_eval])

    def batches(part: list[int]) -> Batches:
        groups = length_groups([lengths[i] for i in part], cfg.batch_size, cfg.bucket, rng)
        return Batches(source, [[part[i] for i in group] for group in groups], cfg.pad_multiple)

    hot = draft_vocab(token_counts(rows.select(train_rows), vocab_size), draft_vocab_size)
    return TrainData(batches(train_rows), batches(eval_rows) if n_eval else None, hot)
