"""Token frequencies of the assistant tokens of a data set -> the draft vocabulary.

    python -m eyas.data.vocab --target smollm2-135m-instruct --data sharegpt.json --size 8192 --output freq_8192.pt

writes an FR-Spec token map (a torch.save'd list of target ids, most frequent first). In Python:

    counts = token_counts(build_dataset(path, tokenizer), vocab_size)   # int64 [vocab]
    hot = draft_vocab(counts)                                            # EAGLE-3 order (ascending id)

Only loss-masked tokens count: the draft head is trained, and scored, on predicting the assistant's tokens.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Literal

import torch
from datasets import Dataset
from torch import Tensor

from eyas.common.assets import resolve_asset_argument
from eyas.common.hot_vocab import HotVocab

DEFAULT_SIZE = 32000


def token_counts(ds: Dataset, vocab_size: int) -> Tensor:
    """int64 `[vocab_size]`: how often each token id occurs where `loss_mask` is 1, over all rows of `ds`."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for batch in ds.select_columns(["input_ids", "loss_mask"]).iter(batch_size=1000):
        ids = torch.tensor([i for row in batch["input_ids"] for i in row], dtype=torch.int64)
        mask = torch.tensor([m for row in batch["loss_mask"] for m in row], dtype=torch.bool)
        ids = ids[mask]
        if len(ids) and ids.max() >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} is past the target's vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def draft_vocab(
    counts: Tensor, size: int = DEFAULT_SIZE, order: Literal["by_id", "by_frequency"] = "by_id"
) -> HotVocab:
    """The `size` most frequent ids (the whole vocab when it is smaller); by_id is EAGLE-3's order."""
    return HotVocab.from_counts(counts, min(size, counts.numel()), order=order)


def main(argv: list[str] | None = None) -> None:
    from eyas.common.checkpoint import target_config
    from eyas.common.cli import HelpFormatter
    from eyas.data.conversations import FORMATS, ConversationError
    from eyas.data.dataset import DataConfig, build_dataset
    from eyas.data.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(
        prog="python -m eyas.data.vocab", formatter_class=HelpFormatter,
        description="Count the assistant (loss-masked) tokens of a conversation file in the target's chat "
        "template and write an FR-Spec token map: a torch.save'd list of the SIZE most frequent target "
        "token ids, most frequent first.",
    )
    parser.add_argument("--target", required=True, help="HF directory, .gguf file, or packaged model name")
    parser.add_argument("--data", required=True,
                        help="ShareGPT JSON, messages JSONL or UltraChat file, or a packaged data set (sharegpt)")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="ids to keep (default %(default)s)")
    parser.add_argument("--output", required=True, type=Path, help="the token map to write, e.g. freq_32000.pt")
    parser.add_argument("--format", choices=FORMATS, help="record layout (default: recognised per record)")
    parser.add_argument(
        "--max-length", type=int, default=DataConfig.max_length, help="tokens kept per row (default %(default)s)"
    )
    parser.add_argument("--num-proc", type=int, help="processes for tokenizing")
    parser.add_argument("--cache-dir", help="datasets' cache (default: its own, ~/.cache/huggingface/datasets)")
    args = parser.parse_args(argv)
    if args.size < 1 or args.max_length < 1:
        parser.error(f"--size and --max-length must be at least 1, got {args.size} and {args.max_length}")
    if not args.output.parent.is_dir() or args.output.is_dir():  # found out now, not after the whole data is counted
        parser.error(f"--output {args.output}: " + ("a directory; give the map's file name" if args.output.is_dir()
                                                     else f"no directory {args.output.parent}"))
    data = resolve_asset_argument(parser, "--data", args.data)  # before the target loads

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    target = resolve_asset_argument(parser, "--target", args.target, kind="target")
    tokenizer = load_tokenizer(target)
    if tokenizer.chat_template is None:  # else the first conversation fails deep inside the tokenizing
        parser.error(f"--target {args.target}: its tokenizer has no chat template (a base model?), so the assistant's "
                     "tokens cannot be found")
    vocab_size = target_config(target).vocab_size
    if len(tokenizer) > vocab_size:  # its ids would count past the target's vocabulary
        parser.error(f"--target {args.target}: its tokenizer has {len(tokenizer)} tokens, more than its config's "
                     f"vocab_size {vocab_size}")
    config = DataConfig(args.max_length, args.format, args.num_proc, args.cache_dir)
    try:
        rows = build_dataset(data, tokenizer, config)
    except ConversationError as e:  # a file with no usable conversation: its message names the file
        parser.error(f"--data: {e}")
    if len(rows) == 0:
        parser.error(f"--data {args.data}: no conversation with loss tokens (all cut off by --max-length "
                     f"{args.max_length}, or skipped by the chat template: see above)")
    counts = token_counts(rows, vocab_size)
    hot = draft_vocab(counts, args.size, order="by_frequency")
    hot.save_token_map(args.output)
    covered = counts[hot.hot_ids].sum() / counts.sum().clamp(min=1)
    unseen = int((counts[hot.hot_ids] == 0).sum())  # padding the map to --size: the lowest ids that never occur
    print(f"wrote {args.output}: {hot.draft_vocab_size} ids covering {covered:.2%} of {int(counts.sum())} loss tokens"
          + (f"; {unseen} of them never occur in the data (it has only {int((counts > 0).sum())} distinct loss "
             "tokens): a smaller --size drops them" if unseen else ""))


if __name__ == "__main__":
    main()
