"""Training metrics: `<output>/metrics.jsonl` (one JSON object per optimizer step or evaluation), optional wandb.

    {"step": 3, "split": "train", "loss": 4.1, "lr": 1e-4, "grad_norm": 0.9, "acc": [0.41, 0.22, ...], "tau": 1.6,
     "tokens": 64}
    {"step": 100, "split": "eval", "loss": 3.2, "acc": [0.52, 0.31, ...], "tau": 1.9, "tokens": 20480}

`acc[i]` is step i's draft accuracy over the counted tokens of the whole optimizer step (all micro-batches
and ranks), `tau` the acceptance length it implies (`ttt.acceptance_length`): what serving should see. Eval lines
measure the same on held-out conversations after step `step` (step 0: the untrained head).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .config import LoggingConfig

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, path: Path, cfg: LoggingConfig, run_config: dict, resume_step: int, final_step: int):
        self.path = path
        if path.exists():
            self._keep_until(resume_step, final_step)
        self.wandb = None
        if cfg.wandb_project is not None:
            import wandb

            # The run's wandb id, kept beside the metrics: a resumed training continues its wandb run, not a new one.
            id_file = path.with_name("wandb-run-id")
            if not id_file.exists():
                id_file.write_text(wandb.util.generate_id() + "\n")
            self.wandb = wandb.init(
                project=cfg.wandb_project, name=cfg.run_name, mode=cfg.wandb_mode, config=run_config,
                dir=str(path.parent), id=id_file.read_text().strip(), resume="allow",
            )

    def _keep_until(self, resume_step: int, final_step: int) -> None:
        """A resumed run repeats the steps after its checkpoint (all of them, the step-0 evaluation included, when it
        starts afresh) and the evaluation that ends a run (at `final_step`, the only one there; a finished run run
        again redoes it): their old lines go. A line cut short by a crash goes too. Rewritten whole, then renamed: a
        crash meanwhile leaves the old file."""
        kept = []
        for number, line in enumerate(self.path.read_text().splitlines(), start=1):
            try:
                record = json.loads(line)
                step, split = record["step"], record["split"]
            except (ValueError, KeyError, TypeError):
                log.warning("%s, line %d: not a metrics record (cut short by a crash?), dropped", self.path, number)
                continue
            repeated = resume_step == 0 or step > resume_step or (step == final_step and split == "eval")
            if not repeated:
                kept.append(line + "\n")
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text("".join(kept))
        os.replace(partial, self.path)

    def log(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            prefix = "eval/" if record["split"] == "eval" else ""
            values = {k: v for k, v in record.items() if k not in ("acc", "split", "step")}
            values |= {f"acc/{i}": a for i, a in enumerate(record["acc"])}
            self.wandb.log({prefix + k: v for k, v in values.items()}, step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
