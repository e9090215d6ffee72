"""Training checkpoints: `<output>/checkpoints/step_N/`, written atomically, resumed exactly.

    step_N/engine/             DeepSpeed's files: module, optimizer (ZeRO partitions), lr scheduler
    step_N/rng_rank{R}.pt      python, numpy and torch (CPU + CUDA) RNG states of rank R
    step_N/trainer_state.json  {"step": N, "position": micro-batches consumed per rank, "data_order": the settings
                               that decide which rows a position means (`check_resumable`), "head": the head's
                               shape and precision and its target's fingerprint (`check_same`), "optimizer":
                               the settings its optimizer and lr schedule states hold (`check_same`), "rows":
                               hashes of the data's rows, their tokens and their lengths (`check_same_rows`)};
                               written last

Every rank writes into `.step_N.tmp/`; after a barrier rank 0 flushes it to disk and renames it to `step_N/`
(`durable_replace`), so a directory named `step_N` is always complete, even after a power loss (a run killed while
saving leaves only a `.tmp`, which is ignored, and deleted by the next run's start or save: `remove_partial`); older
checkpoints are pruned only after that.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from eyas.common.config import ConfigError

_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_DIR = re.compile(r"^\.step_\d+\.(tmp|old)$")  # what a cut-short `save` or `durable_replace` leaves


class Stopped(Exception):
    """A signal stopped training after a checkpoint: `train-eagle` exits as a process killed by it would (128 + its
    number), so that a launcher, scheduler or retry loop sees an unfinished run."""

    def __init__(self, name: str):
        super().__init__(f"stopped by {name}")
        self.exit_status = 128 + signal.Signals[name].value


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, root: Path, step: int, position: int, records: dict, keep_last: int = 0) -> Path:
    """Writes `root/step_{step}` (all ranks call this); prunes to the newest `keep_last` when > 0. `records`:
    {"data_order", "head", "optimizer", "rows"}, what a resume checks (module docstring)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if rank == 0:
        remove_partial(root)  # `tmp` itself too, when a save of this step was cut short
        tmp.mkdir(parents=True)
    _barrier()
    try:
        engine.save_checkpoint(str(tmp), tag="engine", save_latest=False)
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    except (OSError, RuntimeError) as e:  # torch reports a full disk as "unexpected pos ..."
        kept = checkpoints(root)
        raise RuntimeError(f"saving {final.name} into {tmp} failed ({e}); {shutil.disk_usage(root).free / 2**30:.1f} "
                           f"GiB free there. {kept[-1].name if kept else 'No checkpoint'} is the last one kept: make "
                           "room and rerun the same command to resume") from e
    _barrier()
    if rank == 0:
        state = {"step": step, "position": position} | records
        (tmp / "trainer_state.json").write_text(json.dumps(state) + "\n")
        durable_replace(tmp, final)  # a `final` already there: a leftover of a run that died after this step
        if keep_last > 0:
            for old in checkpoints(root)[:-keep_last]:
                # Out of `checkpoints`' sight first: deleted in place, a kill could leave half of one forever.
                aside = old.with_name(f".{old.name}.old")
                os.replace(old, aside)
                shutil.rmtree(aside)
    _barrier()
    return final


def durable_replace(tmp: Path, final: Path) -> None:
    """Puts directory `tmp` at `final` so that a crash or power loss at any moment leaves under that name the old
    version, the new one whole, or nothing: `tmp`'s files and directories are flushed to disk first, and an old
    `final` is renamed aside, not deleted, until the new one is in place."""
    for path in [*tmp.rglob("*"), tmp]:
        _fsync(path)
    aside = final.with_name(f".{final.name}.old")
    shutil.rmtree(aside, ignore_errors=True)
    if final.exists():
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync(final.parent)  # the renames themselves
    shutil.rmtree(aside, ignore_errors=True)


def _fsync(path: Path) -> None:
    """Flushes a file's or a directory's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_partial(root: Path) -> None:
    """Deletes the `.step_N.tmp` and `.step_N.old` directories under `root` that saves cut short left: one of a step
    never saved again would stay forever, holding a whole optimizer state. Rank 0 only, outside `save`: other ranks
    write into a `.tmp` only inside `save`, between the barriers rank 0 meets there."""
    if root.is_dir():
        for path in root.iterdir():
            if _PARTIAL_DIR.match(path.name):
                shutil.rmtree(path)


def checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / "trainer_state.json").exists()]


def check_resumable(path: Path, data_order: dict, total_steps: int) -> None:
    """Raises a ConfigError, before anything loads, when the checkpoint cannot go on under this run's recipe: it is
    past `optim.total_steps`, or its data order differs (another seed, world size or data setting would make its
    position point at other rows). Checkpoints written before the data order was recorded are not compared."""
    state = json.loads((path / "trainer_state.json").read_text())
    if state["step"] > total_steps:
        raise ConfigError(f"{path}: step {state['step']} is past optim.total_steps {total_steps}; raise it to train "
                          "on, or train into another --output")
    changed = _changes(state.get("data_order"), data_order)
    if changed:
        raise ConfigError(f"{path} was trained with other data settings ({changed}), so its data position would "
                          "mean other rows: resume with the same settings, or train into another --output (with "
                          "model.init_from=<its run>/final to train its head further)")


# A resume whose record under the key differs from the checkpoint's: what it would do wrong, what to do instead.
_REFUSALS = {
    "head": "holds another head ({}): its weights or optimizer states would not fit, would feed other layers, or "
            "were learned from another target; resume with the recipe's model settings (model.draft_vocab_size, "
            "model.aux_layers, model.precision, the target) as they were, or train into another --output",
    "optimizer": "holds optimizer states of other settings ({}), which resuming would restore over the recipe's: "
                 "resume with them as they were, or train its head further into another --output with "
                 "model.init_from=<its run>/final (a fresh optimizer)",
}


def check_same(path: Path, key: str, now: dict) -> None:
    """Raises a ConfigError, before the checkpoint loads, when this run's record under `key` ("head": the head's
    config, precision and target's fingerprint; "optimizer": the recipe's peak lr, betas, weight decay and ZeRO stage)
    is not the checkpoint's. Settings one of them did not record (an earlier or later eyas) are not compared."""
    changed = _changes(json.loads((path / "trainer_state.json").read_text()).get(key), now)
    if changed:
        raise ConfigError(f"{path} " + _REFUSALS[key].format(changed))


def check_same_rows(path: Path, rows: dict[str, str]) -> None:
    """Raises a ConfigError when this run's rows (`rows`: `TrainData.rows_record`) are not the checkpoint's: a data
    file edited since (the recipe unchanged) would make its position, and the held-out split, mean other rows. Hashes
    that both record are compared: checkpoints of earlier eyas versions hold the lengths' alone."""
    saved = json.loads((path / "trainer_state.json").read_text()).get("rows")
    if isinstance(saved, str):  # the record of earlier eyas versions
        saved = {"lengths": saved}
    if saved is not None and any(saved[key] != rows[key] for key in saved.keys() & rows.keys()):
        raise ConfigError(f"{path} was trained on other rows than the recipe's data gives now (a data file changed "
                          "since?): its data position would mean other rows; restore the data, or train into another "
                          "--output (with model.init_from=<its run>/final to train its head further)")


def _changes(saved: dict | None, now: dict) -> str:
    """What differs between a recorded dict and this run's ('key: old then, new now; ...'); '' when nothing both
    record does."""
    now = json.loads(json.dumps(now))  # as it would read back: tuples become lists
    if saved is None:
        return ""
    # Keys one side lacks are settings an earlier or later eyas did not record, or no longer does.
    return "; ".join(f"{key}: {saved[key]!r} then, {now[key]!r} now"
                     for key in sorted(saved.keys() & now.keys()) if saved[key] != now[key])


def load(engine, path: Path) -> dict:
    """Restores engine, optimizer, scheduler and this rank's RNG states; returns the trainer state."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    loaded, _ = engine.load_checkpoint(str(path), tag="engine", load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if loaded is None:
        raise RuntimeError(f"checkpoint {path}: DeepSpeed found nothing to load under {path / 'engine'}")
    # Pickled python/numpy RNG states are not plain tensors; our own file, so a full load is safe.
    set_rng_state(torch.load(path / f"rng_rank{rank}.pt", weights_only=False))
    return json.loads((path / "trainer_state.json").read_text())
