"""Helpers of the trainer's tests."""

import json
import os
from pathlib import Path


def launcher_free_env() -> dict[str, str]:
    """os.environ less the rendezvous variables an earlier in-process run left there, so that a child process starts
    its own process group."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}


def metrics(run: Path) -> list[dict]:
    """The records of `run/metrics.jsonl`, less their wall times (which no two runs share)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]
