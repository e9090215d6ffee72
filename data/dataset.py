"""A conversation file -> a cached `datasets.Dataset` of `input_ids` + `loss_mask`, and the batch collator.

    ds = build_dataset("sharegpt.json", tokenizer, DataConfig(max_length=2048))
    loader = DataLoader(ds, batch_size=8, collate_fn=collate)

Both steps go through `datasets`' cache (`cache_dir`, default ~/.cache/huggingface/datasets), so a second
run with the same file, tokenizer and config loads Arrow files instead of re-reading and re-tokenizing:
  - the conversations: `Dataset.from_generator`, keyed on the path, size and mtime of the file, the format and
    max_bytes;
  - the tokens: `map`, keyed on that dataset's fingerprint and a hash of the tokenizer and max_length.
The conversations are keyed on `SOURCE_STAMP` too, a hash of the code that reads and masks conversations (and so
the tokens, through their fingerprint): `datasets` keys a module's function on its name, not its code, so a fixed
reader would otherwise be served the old rows.
Skipped records are reported (logged) when the file is read, and again by each run that takes its conversations from
the cache (the report is kept beside them).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset, Features, Value
from datasets.exceptions import DatasetGenerationError
from transformers import PreTrainedTokenizerBase

from eyas.data.conversations import FORMATS, ConversationError, ReadReport, read_placed_conversations
from eyas.data.loss_mask import TemplateMismatch, render_with_spans, tokenize_rendered
from eyas.data.tokenizer import end_of_turn_id

logger = logging.getLogger(__name__)

# The modules whose code decides the cached rows: this one, the reader, the chat template and the masking.
SOURCE_STAMP = hashlib.sha256(b"".join(
    (Path(__file__).parent / name).read_bytes() for name in ("dataset.py", "conversations.py", "loss_mask.py",
                                                             "tokenizer.py")
)).hexdigest()[:16]

# A list literal is a list feature in every datasets version (`List` is new in 4.0). `place`: where in the file
# ("line 3", "record 3"), for messages about the conversation.
MESSAGES = Features({"place": Value("string"), "messages": [{"role": Value("string"), "content": Value("string")}]})


@dataclass
class DataConfig:
    max_length: int = 2048  # tokens kept per conversation (its first ones)
    format: str | None = None  # one of conversations.FORMATS; None recognises each record by its keys
    num_proc: int | None = None  # processes for tokenizing; None tokenizes in this process
    cache_dir: str | None = None  # datasets' cache; None is its default
    max_bytes: int | None = None  # read only the file's first bytes (a quick subset of a large file)

    def __post_init__(self):
        if self.max_length < 1:
            raise ValueError(f"max_length must be positive, got {self.max_length}")
        if self.format is not None and self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS} or None, got {self.format!r}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"max_bytes must be positive or None, got {self.max_bytes}")


def load_conversations(path: str | Path, config: DataConfig | None = None) -> Dataset:
    """The file's conversations as a Dataset with columns `place` and `messages`; `config.max_bytes` reads only the
    file's start (see `read_conversations`)."""
    config = config or DataConfig()
    path = Path(path).resolve()
    stat = path.stat()
    # One string, not a dict of lists (datasets shards list-valued gen_kwargs); `stamp` only keys the cache.
    source = json.dumps({"path": str(path), "format": config.format, "max_bytes": config.max_bytes,
                         "stamp": f"{stat.st_size}-{stat.st_mtime_ns}-{SOURCE_STAMP}"})
    try:
        conversations = Dataset.from_generator(_generate, features=MESSAGES, cache_dir=config.cache_dir,
                                               gen_kwargs={"source": source})
    except DatasetGenerationError as e:  # datasets wraps the reader's error: show the reader's own message
        if isinstance(e.__cause__, ConversationError):
            raise e.__cause__ from None
        raise
    _keep_or_repeat_report(conversations, _READ_NOW.pop(source, None))
    return conversations


_READ_NOW: dict[str, ReadReport] = {}  # `_generate`'s reports by its `source`, for `load_conversations`
REPORT_FILE = "eyas-read-report.json"


def _keep_or_repeat_report(conversations: Dataset, report: ReadReport | None) -> None:
    """The reader's report of a file read now is kept beside its cached conversations; a later run that takes them
    from the cache logs it again, so that records skipped there are not skipped silently."""
    if not conversations.cache_files:  # held in memory: every run reads the file
        return
    kept = Path(conversations.cache_files[0]["filename"]).parent / REPORT_FILE
    if report is not None:
        kept.write_text(json.dumps({"summary": report.summary(), "warn": bool(report.skipped or report.truncated)}))
    elif kept.exists() and (earlier := json.loads(kept.read_text()))["warn"]:
        logger.warning(f"{earlier['summary']} (read earlier; its conversations now come from the cache)")


def build_dataset(path: str | Path, tokenizer: PreTrainedTokenizerBase, config: DataConfig | None = None) -> Dataset:
    """Columns `input_ids` and `loss_mask` (int lists of equal length <= max_length), one row per
    conversation that has at least one loss token (conversations whose assistant part was cut off by
    max_length, or whose template rewrites assistant content, are dropped and logged)."""
    config = config or DataConfig()
    conversations = load_conversations(path, config)
    ds = conversations.map(
        _tokenize_batch,
        batched=True,
        fn_kwargs={
            "tokenizer": tokenizer,
            "end_of_turn": end_of_turn_id(tokenizer),
            "max_length": config.max_length,
            "source": str(path),
        },
        remove_columns=["place", "messages"],
        num_proc=config.num_proc,
        desc="tokenizing",
    )
    if len(ds) < len(conversations):
        logger.warning(f"{path}: dropped {len(conversations) - len(ds)} conversations: those the template skipped "
                       "(above) and those without loss tokens (an assistant part cut off by max_length)")
    return ds


def _generate(source: str):
    """`load_conversations`' rows of the file `source` names (JSON: path, format, max_bytes, stamp)."""
    args, report = json.loads(source), ReadReport()
    for place, messages in read_placed_conversations(args["path"], format=args["format"],
                                                     max_bytes=args["max_bytes"], report=report):
        yield {"place": place, "messages": messages}
    if report.conversations == 0:  # else `datasets` fails later with "Instruction 'train' corresponds to no data"
        forced = (f" (format {args['format']!r} forced: set `format` to match the file, or leave it unset)"
                  if args["format"] else "")
        raise ConversationError(f"no usable conversation{forced}: {report.summary()}")
    _READ_NOW[source] = report


def _tokenize_batch(
    batch: dict, tokenizer: PreTrainedTokenizerBase, end_of_turn: int | None, max_length: int, source: str,
) -> dict[str, list]:
    rendered = []
    for place, messages in zip(batch["place"], batch["messages"], strict=True):
        try:
            rendered.append(render_with_spans(tokenizer, messages))
        except TemplateMismatch as e:
            logger.warning(f"{source}: skipping the conversation at {place}: {e}")
    rows = [row for row in tokenize_rendered(tokenizer, rendered, end_of_turn, max_length) if any(row["loss_mask"])]
    return {"input_ids": [row["input_ids"] for row in rows], "loss_mask": [row["loss_mask"] for row in rows]}


def collate(rows: list[dict], pad_id: int = 0, multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded batch: `input_ids [B, T]` long, `loss_mask [B, T]` long, `attention_mask [B, T]` long,
    T the longest row rounded up to `multiple` (few distinct shapes). Padding is masked out of both attention
    and loss, so `pad_id` only fills space."""
    input_ids = [torch.as_tensor(row["input_ids"], dtype=torch.long) for row in rows]
    return {
        "input_ids": pad_right(input_ids, multiple, pad_id),
        "loss_mask": pad_right([torch.as_tensor(row["loss_mask"], dtype=torch.long) for row in rows], multiple),
        "attention_mask": pad_right([torch.ones_like(ids) for ids in input_ids], multiple),
    }


def pad_right(rows: list[torch.Tensor], multiple: int = 1, value: int = 0) -> torch.Tensor:
    """`[B, T, ...]`: the rows (`[n_i, ...]`, alike past dim 0) stacked in the first row's dtype, each followed by
    `value` up to T, the longest n_i rounded up to `multiple`. Every tensor of a batch pads to the same T."""
    T = -(-max(len(row) for row in rows) // multiple) * multiple
    out = rows[0].new_full((len(rows), T, *rows[0].shape[1:]), value)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out
