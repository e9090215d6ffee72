"""Speculation settings per batch size: measured by `bench-eagle --autotune FILE`, used by
`serve-eagle --autotune FILE`.

    {"best_setting_by_batch_size": {"1": "7,1,8", "8": "5,4,8", "32": "off"}}

A setting is "off" (verify the root alone: plain decoding) or "num_steps,topk,num_draft_tokens". A decode
step of B requests uses the setting of the smallest measured batch size >= B, or of the largest one when B
is past them all: speculation is only kept where it measured faster than none.
"""

from __future__ import annotations

import json
from pathlib import Path

from .draft import TreeShape

KEY = "best_setting_by_batch_size"

# (batch size, setting) pairs in increasing batch size; None = no speculation.
TreeByBatch = tuple[tuple[int, TreeShape | None], ...]


def parse_setting(text: str) -> TreeShape | None:
    """"off" -> None; "7,1,8" -> TreeShape(7, 1, 8)."""
    if text == "off":
        return None
    parts = text.split(",") if isinstance(text, str) else []
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"expected 'off' or 'num_steps,topk,num_draft_tokens', got {text!r}")
    return TreeShape(*(int(p) for p in parts))


def format_setting(shape: TreeShape | None) -> str:
    return "off" if shape is None else f"{shape.num_steps},{shape.topk},{shape.num_draft_tokens}"


def write_autotune(path: Path, best: dict[int, TreeShape | None]) -> None:
    path.write_text(json.dumps({KEY: {str(b): format_setting(s) for b, s in sorted(best.items())}}, indent=2) + "\n")


def read_autotune(path: Path) -> TreeByBatch:
    """The file's settings, checked: errors name the file and the entry at fault."""
    try:
        table = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    table = table.get(KEY) if isinstance(table, dict) else None
    if not isinstance(table, dict):
        raise ValueError(f"{path}: not an autotune file ({{\"{KEY}\": {{batch size: setting}}}}, as bench-eagle "
                         "--autotune writes)")
    out = {}
    for batch, setting in table.items():
        try:
            if not batch.isdigit() or int(batch) < 1:
                raise ValueError(f"batch size must be a positive integer, got {batch!r}")
            if int(batch) in out:
                raise ValueError(f"batch size {int(batch)} is given twice")
            out[int(batch)] = parse_setting(setting)
        except ValueError as e:
            raise ValueError(f"{path}: entry {batch!r}: {e}") from e
    if not out:
        raise ValueError(f"{path}: no settings")
    return tuple(sorted(out.items()))


def setting_for(table: TreeByBatch, batch: int) -> TreeShape | None:
    """The setting a decode step of `batch` requests uses (see the module docstring)."""
    return next((shape for size, shape in table if size >= batch), table[-1][1])
