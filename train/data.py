"""Training data: the recipe's rows (the conversations of `data.path`'s sources, each tokenized by `eyas.data` and
cached, or synthetic rows) -> a held-out split, the draft vocabulary and length-bucketed micro-batches, read from
the rows themselves or, offline, from the target's hidden states dumped for them.

    rows = load_rows(recipe, vocab_size=49152)
    data = load_data(recipe.data, rows, vocab_size=49152, draft_vocab_size=8192, seed=0)
    data.train[i]   # micro-batch i: {"input_ids", "loss_mask", "attention_mask"} [B, T] int64 (batches.Batches)
    data.eval       # the held-out rows, batched the same way
    data.hot        # the draft vocabulary: the most frequent assistant tokens of the training rows (repeats count)

The rows hold each conversation once (so does an offline dump); a source's `repeat` applies after the held-out
split, to the training rows. The row order is a seeded shuffle; windows of `bucket` micro-batches are sorted by
length before they are cut into micro-batches (less padding), and the micro-batches are shuffled again. The same
seed and sources (with their repeats) give the same batches, so a resumed run continues exactly where the
interrupted one stopped. Synthetic rows are batched in order, all of them for training. Offline (`states`), the
same micro-batches are collated from the dumped rows, which carry the target's states besides the tokens.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, concatenate_datasets
from torch import Tensor

from eyas.common.assets import resolve_asset, resolve_target
from eyas.common.config import ConfigError
from eyas.common.hot_vocab import HotVocab
from eyas.data.conversations import ConversationError
from eyas.data.dataset import build_dataset
from eyas.data.hidden_states import HiddenStateDataset, check_rows
from eyas.data.tokenizer import load_tokenizer
from eyas.data.vocab import draft_vocab, token_counts

from .batches import Batches, synthetic_rows
from .config import DataConfig, Source, TrainRecipe

SOURCE = "source"  # load_rows' column: the row's source, an index into `data.sources()`


@dataclass
class TrainData:
    train: Batches
    eval: Batches | None  # None: no rows held out
    count_hot: Callable[[], HotVocab]  # counts the draft vocabulary (`hot`)
    # What a checkpoint records of the rows (trainer; checkpoint.check_same_rows), since its data position means other
    # rows once a file is edited (the recipe unchanged): {"tokens": a hash of their tokens (`lengths_and_digest`),
    # "lengths": a hash of their lengths only}. The latter is what checkpoints of earlier eyas versions recorded (as a
    # plain string), kept to check those against.
    rows_record: dict[str, str]

    @functools.cached_property
    def hot(self) -> HotVocab:
        """Counted when first read: a run that keeps an earlier head's vocabulary (model.init_from) never counts it."""
        return self.count_hot()


def load_rows(recipe: TrainRecipe, vocab_size: int) -> Dataset:
    """The recipe's rows, columns `input_ids` and `loss_mask` (int lists): the conversations of `data.path`'s
    sources, each once, in order (column `source`: the index of the row's source), in the chat template of
    `data.tokenizer` (default: the target's), at most `data.max_conversations` of them; or `data.synthetic`.
    What training batches and what `train-eagle --dump-hidden-states` runs the target over, row i for row i."""
    cfg = recipe.data
    if cfg.synthetic is not None:
        return synthetic_rows(cfg.synthetic, vocab_size)
    sources, paths, (tokenizer_key, tokenizer_source, tokenizer_path) = data_inputs(recipe)
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.chat_template is None:  # else the first conversation fails deep inside the tokenizing
        raise ConfigError(f"{tokenizer_key} {tokenizer_source}: its tokenizer has no chat template (a base model?), so "
                          "the assistant's tokens cannot be found: set data.tokenizer to a model whose template to "
                          "train in, e.g. the instruct model of the same vocabulary")
    if len(tokenizer) > vocab_size:  # its ids would index past the target's embedding
        raise ConfigError(f"the tokenizer of {tokenizer_source} has {len(tokenizer)} tokens, more than the target's "
                          f"vocabulary of {vocab_size}: set data.tokenizer to the target's own")
    # Each source is tokenized and cached on its own (keyed on its file), so changing the mix reuses every cache;
    # repeats are not materialized here but applied to the training split (load_data).
    parts = []
    for source, path in zip(sources, paths, strict=True):
        try:
            parts.append(build_dataset(path, tokenizer, cfg))
        except ConversationError as e:  # a file with no usable conversation, or a bad record in strict mode
            raise ConfigError(f"{source.key}: {e}") from None
        if not len(parts[-1]):
            raise ConfigError(f"{source.key}: no conversation of {path} gave a row with loss tokens (the warnings "
                              "above say why each was dropped)")
    rows = concatenate_datasets([part.add_column(SOURCE, [k] * len(part)) for k, part in enumerate(parts)])
    if cfg.max_conversations is not None:
        rows = rows.select(range(min(cfg.max_conversations, len(rows))))
    return rows


def data_inputs(recipe: TrainRecipe) -> tuple[list[Source], list[Path], tuple[str, str, Path]]:
    """The conversation rows' inputs, resolved (packaged data sets fetched) without reading them: `data.path`'s
    sources and their paths, and the tokenizer's (recipe key naming it, its value there, path). A source or tokenizer
    that does not exist, or a file listed twice, is a `ConfigError` naming its key."""
    cfg = recipe.data
    if cfg.path is None:
        raise ConfigError("no training data: set data.path or data.synthetic in the recipe")
    tokenizer_key = "data.tokenizer" if cfg.tokenizer else "model.target"
    tokenizer_source = cfg.tokenizer or recipe.model.target
    if tokenizer_source is None:
        raise ConfigError("data.path with a random target needs data.tokenizer (a target whose tokenizer to use)")
    sources = cfg.sources()
    paths = [_resolve(s) for s in sources]  # all of them before tokenizing any: a typo fails at once
    for i, path in enumerate(paths):
        if path in paths[:i]:  # its copies could then land in both the training and the held-out rows
            first = sources[paths.index(path)].key
            raise ConfigError(f"{sources[i].key}: {path} is also {first}; list it once, with a repeat")
    try:
        tokenizer_path = resolve_target(tokenizer_source)
    except FileNotFoundError as e:
        raise ConfigError(f"{tokenizer_key}: {e}") from None
    return sources, paths, (tokenizer_key, tokenizer_source, tokenizer_path)


def check_fits_context(cfg: DataConfig, context: int) -> None:
    """Refuses rows longer than the target's context (`max_position_embeddings`, capped at a sliding window the
    target uses): past it the target's logits and hidden states, the head's labels and inputs, would be wrong."""
    key, longest = (("data.synthetic.seq_len", cfg.synthetic.seq_len) if cfg.synthetic is not None
                    else ("data.max_length", cfg.max_length))
    if longest > context:
        raise ConfigError(f"{key} {longest} exceeds the target's context of {context} tokens (its "
                          "max_position_embeddings, or its sliding window): lower it")


def _resolve(source: Source) -> Path:
    try:
        path = resolve_asset(source.path).resolve()
    except FileNotFoundError as e:
        raise ConfigError(f"{source.key}: {e}") from None
    if path.is_dir():  # else `datasets` fails on it deep inside its builder, the key and the reason lost
        raise ConfigError(f"{source.key}: {path} is a directory; give a conversations file (JSON or JSONL)")
    return path


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


def lengths_and_digest(rows: Dataset) -> tuple[list[int], str]:
    """The rows' lengths, and a hash of their `input_ids` and `loss_mask` (16 hex digits): rows edited to other tokens
    of the same lengths hash differently. Read as Arrow columns, never as Python lists: 0.4 s for 100k rows of ~500
    tokens (converting them to lists only to count their lengths took 1.7 s)."""
    # Three streams hashed apart, so that the digest does not depend on how the rows are batched here: the lengths
    # (the loss_mask's are the same), all input_ids in row order, all loss_mask values; each as int32, whatever int
    # type the columns hold.
    streams = [hashlib.sha256() for _ in range(3)]
    lengths = []
    for batch in rows.with_format("arrow").select_columns(["input_ids", "loss_mask"]).iter(1000):
        n = pc.list_value_length(batch["input_ids"])  # [rows]
        parts = (n, pc.list_flatten(batch["input_ids"]), pc.list_flatten(batch["loss_mask"]))  # [rows], [tokens] x2
        for h, part in zip(streams, parts, strict=True):
            h.update(part.cast(pa.int32()).to_numpy())
        lengths += n.to_pylist()
    return lengths, hashlib.sha256(b"".join(h.digest() for h in streams)).hexdigest()[:16]


def repeated_token_counts(rows: Dataset, part: list[int], times: list[int], vocab_size: int) -> Tensor:
    """`token_counts` [vocab_size] of rows `part` with row i there `times[i]` times (as it is trained on), each row
    read once: the rows of each repeat are counted together, then scaled by it."""
    return sum(t * token_counts(rows.select([i for i in part if times[i] == t]), vocab_size) for t in set(times))


def load_data(
    cfg: DataConfig, rows: Dataset, vocab_size: int, draft_vocab_size: int, seed: int,
    states: HiddenStateDataset | None = None,
) -> TrainData:
    """Splits and batches `rows` (`load_rows`); with `states` (the target's hidden states dumped for these rows,
    checked to hold these rows), the micro-batches are collated from them instead."""
    lengths, digest = lengths_and_digest(rows)
    record = {"tokens": digest, "lengths": hashlib.sha256(str(lengths).encode()).hexdigest()[:16]}
    if states is not None and states.lengths != lengths:
        if states.lengths == lengths[: len(states)]:
            raise ConfigError(f"{states.path}: holds the first {len(states)} of the recipe's {len(rows)} rows; finish "
                             "the dump (rerun train-eagle --dump-hidden-states: it resumes)")
        raise ConfigError(f"{states.path}: dumped from other data (its {len(states)} rows differ in number or length "
                         f"from the recipe's {len(rows)}); dump this recipe's into another directory")
    if states is not None:  # rows of the same lengths may still be other tokens
        check_rows(states.path, states.shards, rows.select_columns(["input_ids", "loss_mask"]))
    # Batches collate every column of their rows: leave out load_rows' `source`.
    batch_rows = rows.select_columns(["input_ids", "loss_mask"]) if states is None else states

    if cfg.synthetic is not None:
        size = cfg.synthetic.batch_size
        groups = [list(range(i, i + size)) for i in range(0, len(rows), size)]  # synthetic_rows' batches
        return TrainData(Batches(batch_rows, groups, cfg.pad_multiple), None,
                         lambda: draft_vocab(token_counts(rows, vocab_size), draft_vocab_size), record)

    rng = random.Random(seed)
    order = rng.sample(range(len(rows)), len(rows))
    # At least one row when asked for any: else a small data set would silently skip every evaluation.
    n_eval = max(1, round(cfg.eval_fraction * len(rows))) if cfg.eval_fraction else 0
    if n_eval >= len(rows):
        raise ConfigError(f"{cfg.path}: {len(rows)} rows leave none for training after holding out {n_eval}")
    # Split the distinct conversations, then repeat each training one as often as its source says: all copies of a
    # conversation land on the same side. Eval rows count once.
    repeats = [s.repeat for s in cfg.sources()]
    times = [repeats[k] for k in rows[SOURCE]]
    distinct_train = sorted(order[n_eval:])
    train_rows = [i for i in distinct_train for _ in range(times[i])]
    eval_rows = sorted(order[:n_eval])

    def batches(part: list[int]) -> Batches:
        groups = length_groups([lengths[i] for i in part], cfg.batch_size, cfg.bucket, rng)
        return Batches(batch_rows, [[part[i] for i in group] for group in groups], cfg.pad_multiple)

    counts = functools.partial(repeated_token_counts, rows, distinct_train, times, vocab_size)
    return TrainData(batches(train_rows), batches(eval_rows) if n_eval else None,
                     lambda: draft_vocab(counts(), draft_vocab_size), record)
