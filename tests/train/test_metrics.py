"""metrics.jsonl on resume: the lines of the steps and the evaluation a resumed run repeats go, and so does a line a
crash cut short."""

import json
import logging
import sys
import types

from eyas.train.config import LoggingConfig
from eyas.train.metrics import MetricsLog


def write(path, records, torn=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)


def test_resume_keeps_the_lines_up_to_its_checkpoint(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 0, "split": "eval"}, {"step": 1, "split": "train"}, {"step": 2, "split": "train"},
               {"step": 2, "split": "eval"}, {"step": 3, "split": "train"}]
    write(path, records, torn='{"step": 4, "spl')
    MetricsLog(path, LoggingConfig(), {}, resume_step=2, final_step=4).log({"step": 3, "split": "train", "acc": []})
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:4] + [
        {"step": 3, "split": "train", "acc": []}]
    assert "metrics.jsonl, line 6: not a metrics record" in caplog.text and not list(tmp_path.glob("*.partial"))


def test_a_fresh_start_drops_every_line(tmp_path, caplog):
    """No checkpoint: the run starts again at step 0, whose evaluation it logs again."""
    path = tmp_path / "metrics.jsonl"
    write(path, [{"step": 0, "split": "eval"}, {"step": 1, "split": "train"}])
    with caplog.at_level(logging.WARNING):
        MetricsLog(path, LoggingConfig(), {}, resume_step=0, final_step=4)
    assert path.read_text() == "" and not caplog.text


def test_a_finished_run_run_again_drops_its_final_evaluation(tmp_path):
    """Resumed at its last step, a run only evaluates and exports again: its final evaluation's line is replaced, not
    repeated; the train line of that step stays."""
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 0, "split": "eval"}, {"step": 1, "split": "train"}, {"step": 2, "split": "train"},
               {"step": 2, "split": "eval"}]
    write(path, records)
    MetricsLog(path, LoggingConfig(), {}, resume_step=2, final_step=2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:3]


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    """wandb (not installed here: a stand-in records what `init` is given) gets one id per output directory, the
    same on every resume, so a resumed training logs into its run instead of starting another."""
    inits = []
    ids = iter(["first", "second"])
    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw), util=types.SimpleNamespace(
        generate_id=lambda: next(ids)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = LoggingConfig(wandb_project="eyas")
    for resume_step in (0, 2):
        MetricsLog(tmp_path / "metrics.jsonl", cfg, {}, resume_step=resume_step, final_step=4)
    (tmp_path / "other").mkdir()
    MetricsLog(tmp_path / "other" / "metrics.jsonl", cfg, {}, resume_step=0, final_step=4)
    assert [kw["id"] for kw in inits] == ["first", "first", "second"] and all(kw["resume"] == "allow" for kw in inits)
