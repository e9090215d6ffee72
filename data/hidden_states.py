"""Offline hidden states: run the target once over a tokenized dataset, store what training reads, stream it back.

    dump_hidden_states(target, build_dataset(...), "states/", aux_layers, store="hidden")
    ds = HiddenStateDataset("states/", target, aux_layers)       # refuses shards of another target or aux_layers
    loader = DataLoader(ds, batch_size=8, collate_fn=collate_hidden_states)
    for batch in loader:   # input_ids, loss_mask, attention_mask [B, T]; aux [B, T, 3·H]; hidden [B, T, H]
        logits = target.logits(batch["hidden"])                  # store="logits": batch["logits"] [B, T, V]

`aux_layers` follows `TargetModel.forward`: the residual stream *entering* each listed layer. For a training
recipe with `data.hidden_states: DIR`, `train-eagle --recipe R --dump-hidden-states` dumps its rows into DIR, and the
trainer reads them from there.

Layout of the output directory; conversation i is the i-th row of the dumped dataset:

    shard_00000.safetensors   conversations 0..n0-1, keys `{i}.input_ids` int32 [T], `{i}.loss_mask` uint8 [T],
    shard_00001.safetensors   `{i}.aux` [T, 3·H] and `{i}.hidden` [T, H] (or `{i}.logits` [T, V]), target dtype
    ...
    index.json                metadata (target, aux_layers, dtype, store) + shards [{file, lengths, digest}], in
                              order: shard k holds the len(lengths) conversations following those of shards
                              0..k-1; `digest` hashes their input_ids and loss_mask (`rows_digest`)

Size per token, Llama-3.1-8B in bf16: aux 3·4096·2 = 24576 B + hidden 4096·2 = 8192 B + ids/mask 5 B ≈ 32 KiB
(1M tokens ≈ 33 GB); store="logits" would put 128256·2 = 250 KiB in place of the hidden state's 8 KiB.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor
from tqdm import tqdm

from eyas.common.attention import CausalAttention
from eyas.common.checkpoint import save_safetensors
from eyas.common.config import ConfigError
from eyas.common.target import TargetModel
from eyas.data.dataset import collate, pad_right

INDEX = "index.json"
STORES = ("hidden", "logits")


def target_fingerprint(target: TargetModel) -> dict:
    """{"model_type", "hash"}: a hash of the config and of a few weights (a base and an instruct model share a
    config). Weights are rounded to bf16 first, so fp32 and bf16 loads of one checkpoint match."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(target.config), sort_keys=True, default=str).encode())
    for w in (target.model.norm.weight, target.lm_head_weight[:8]):
        h.update(w.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return {"model_type": target.config.model_type, "hash": h.hexdigest()[:16]}


def _metadata(target: TargetModel, aux_layers: Sequence[int], store: str) -> dict:
    return {
        "target": target_fingerprint(target),
        "aux_layers": list(aux_layers),
        "hidden_size": target.config.hidden_size,
        "dtype": str(target.embed_tokens.weight.dtype).removeprefix("torch."),
        "store": store,
    }


def check_dumped(path: str | Path) -> None:
    """A ConfigError unless `path` holds a dump's index (a training run checks before its target loads)."""
    if not (Path(path) / INDEX).is_file():
        raise ConfigError(f"{path}: no {INDEX}; dump the hidden states there first (dump_hidden_states; for a "
                          "training recipe with data.hidden_states: train-eagle --recipe R --dump-hidden-states)")


def _read_index(path: Path) -> dict:
    check_dumped(path)
    return json.loads((path / INDEX).read_text())


def rows_digest(rows: Iterable[dict]) -> str:
    """A hash of the rows' input_ids and loss_mask (16 hex digits): which conversations a shard holds."""
    h = hashlib.sha256()
    for row in rows:
        for key in ("input_ids", "loss_mask"):
            values = torch.as_tensor(row[key]).to(torch.int32)
            h.update(len(values).to_bytes(8, "little") + values.numpy().tobytes())
    return h.hexdigest()[:16]


def check_rows(path: Path, shards: list[dict], rows: Iterable[dict]) -> Iterator[dict]:
    """Refuses (ConfigError) `rows` whose first ones are not the conversations `shards` hold, compared shard by
    shard; returns the iterator of the rows after them."""
    rows, start = iter(rows), 0
    for shard in shards:
        n = len(shard["lengths"])
        if "digest" not in shard:
            raise ConfigError(f"{path}: {shard['file']} has no digest of its rows (an earlier eyas dumped it); dump "
                             "this data into another directory")
        if rows_digest(itertools.islice(rows, n)) != shard["digest"]:
            raise ConfigError(f"{path}: {shard['file']} holds other conversations than rows {start}..{start + n - 1} "
                             "of this data; dump this data into another directory")
        start += n
    return rows


def _check(path: Path, index: dict, expected: dict) -> None:
    for key, want in expected.items():
        if index[key] != want:
            raise ConfigError(
                f"{path}: hidden states were dumped with {key}={index[key]}, but this run has {key}={want}; "
                "dump them again for this target (into another directory)"
            )


@torch.no_grad()
def dump_hidden_states(
    target: TargetModel,
    rows: Iterable[dict],
    out_dir: str | Path,
    aux_layers: Sequence[int],
    shard_size_mb: float = 512,
    store: str = "hidden",
) -> None:
    """Runs `target` once per row ({"input_ids", "loss_mask"} int lists or tensors [T], e.g. `build_dataset`'s)
    and writes the shards and index described in the module docstring. A shard is closed once its tensors reach
    `shard_size_mb`. Resumable: conversations in the shards already listed in the index (up to the first missing
    file) are skipped, once their rows are checked to be these rows' first ones; each shard is written to a temp name
    and renamed, then the index is rewritten atomically."""
    if store not in STORES:
        raise ValueError(f"store must be one of {STORES}, got {store!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = _metadata(target, aux_layers, store)
    if (out_dir / INDEX).is_file():
        index = _read_index(out_dir)
        _check(out_dir, index, meta)
        index["shards"] = list(itertools.takewhile(lambda s: (out_dir / s["file"]).is_file(), index["shards"]))
    else:
        index = {**meta, "shards": []}
    done = sum(len(s["lengths"]) for s in index["shards"])
    todo = check_rows(out_dir, index["shards"], rows)  # the rows after the dumped ones

    device = target.embed_tokens.weight.device
    bar = tqdm(total=len(rows) if hasattr(rows, "__len__") else None, initial=done, desc="hidden states",
               unit="conv")
    tensors, lengths, size = {}, [], 0
    for i, row in enumerate(todo, start=done):
        input_ids = torch.as_tensor(row["input_ids"], device=device)[None]  # [1, T]
        T = input_ids.shape[1]
        out = target(input_ids, torch.arange(T, device=device)[None], CausalAttention(), aux_layers=aux_layers)
        conversation = {
            "input_ids": input_ids[0].int(),
            "loss_mask": torch.as_tensor(row["loss_mask"]).to(torch.uint8),
            "aux": out.aux[0],  # [T, 3·H]
            store: out.hidden[0] if store == "hidden" else target.logits(out.hidden[0]),  # [T, H] or [T, V]
        }
        for key, t in conversation.items():
            tensors[f"{i}.{key}"] = t.cpu().contiguous()
            size += t.nbytes
        lengths.append(T)
        bar.update()
        if size >= shard_size_mb * 2**20:
            _write_shard(out_dir, index, tensors, lengths)
            tensors, lengths, size = {}, [], 0
    if lengths:
        _write_shard(out_dir, index, tensors, lengths)
    bar.close()


def _write_shard(out_dir: Path, index: dict, tensors: dict[str, Tensor], lengths: list[int]) -> None:
    """Writes conversations first .. first + len(lengths) - 1 (first: the count in the shards before)."""
    name = f"shard_{len(index['shards']):05d}.safetensors"
    save_safetensors(tensors, out_dir / f".{name}.tmp")
    os.replace(out_dir / f".{name}.tmp", out_dir / name)
    first = sum(len(s["lengths"]) for s in index["shards"])
    digest = rows_digest({key: tensors[f"{i}.{key}"] for key in ("input_ids", "loss_mask")}
                         for i in range(first, first + len(lengths)))
    index["shards"].append({"file": name, "lengths": lengths, "digest": digest})
    (out_dir / f".{INDEX}.tmp").write_text(json.dumps(index, indent=1))
    os.replace(out_dir / f".{INDEX}.tmp", out_dir / INDEX)


class HiddenStateDataset(torch.utils.data.Dataset):
    """The dumped conversations, read on demand from the memory-mapped shards. Row i: `input_ids`, `loss_mask`
    int64 [T], `aux` [T, 3·H] and `hidden` [T, H] (or `logits` [T, V]) in the dump's dtype.

    Refuses (ConfigError) shards dumped from another target (config or weights) or with other aux_layers."""

    def __init__(self, path: str | Path, target: TargetModel, aux_layers: Sequence[int]):
        self.path = Path(path)
        index = _read_index(self.path)
        _check(self.path, index, {"target": target_fingerprint(target), "aux_layers": list(aux_layers)})
        self.store = index["store"]  # "hidden" or "logits": the key of the last tensor of each row
        self.shards = index["shards"]  # [{file, lengths, digest}] (module docstring)
        self.files = [s["file"] for s in index["shards"]]
        if missing := [f for f in self.files if not (self.path / f).is_file()]:  # else found mid-training
            raise ConfigError(f"{self.path}: {missing[0]} ({len(missing)} of the {len(self.files)} shards {INDEX} "
                              "lists are missing); rerun the dump (train-eagle --dump-hidden-states): it resumes at "
                              "the first missing shard")
        self.shard_of = [k for k, s in enumerate(index["shards"]) for _ in s["lengths"]]  # conversation -> shard
        self.lengths = [n for s in index["shards"] for n in s["lengths"]]  # conversation -> T
        self._open: dict[int, safe_open] = {}

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        k = self.shard_of[i]
        if k not in self._open:
            self._open[k] = safe_open(self.path / self.files[k], framework="pt")
        f = self._open[k]
        row = {key: f.get_tensor(f"{i}.{key}") for key in ("input_ids", "loss_mask", "aux", self.store)}
        row["input_ids"], row["loss_mask"] = row["input_ids"].long(), row["loss_mask"].long()
        return row

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}}  # open file handles do not pickle (DataLoader workers reopen them)


def collate_hidden_states(rows: list[dict], multiple: int = 1) -> dict[str, Tensor]:
    """`data.dataset.collate`'s right-padded batch (T rounded up to `multiple`) plus `aux` [B, T, 3·H] and
    `hidden` [B, T, H] (or `logits` [B, T, V]), zero past each row's end: each row copied once."""
    batch = collate(rows, multiple=multiple)
    return batch | {key: pad_right([row[key] for row in rows], multiple) for key in rows[0] if key not in batch}
