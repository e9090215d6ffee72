"""The trainer end to end through DeepSpeed (one CPU process): ci-tiny writes metrics, checkpoints and a head
that loads; a run stopped mid-way, killed with SIGKILL (training online or from dumped hidden states) or stopped by
SIGTERM (which checkpoints the step it was on), resumes to bit-identical weights and metrics; ZeRO-3 trains, resumes
and exports as ZeRO-1 does; the loss falls on an overfit."""

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.common.architectures import architecture_config
from eyas.common.config import ConfigError, TargetConfig
from eyas.common.head_checkpoint import load_draft_head
from eyas.train import checkpoint, trainer
from eyas.train import data as train_data
from eyas.train.config import ModelConfig, load_recipe
from eyas.train.optim import deepspeed_config, lr_factor
from eyas.train.target import build_random_target
from eyas.train.trainer import StopSignal, dump, train
from tests.train import launcher_free_env, metrics

QUIET = ["logging.progress=false"]
# Every parameter partitioned: DeepSpeed keeps those under 1e5 elements (all of ci-tiny's head) whole by default.
ZERO3 = ["deepspeed.zero_stage=3", 'deepspeed.extra={"zero_optimization": {"stage3_param_persistence_threshold": 0}}']


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("full")
    recipe = load_recipe("ci-tiny", QUIET)
    assert train(recipe, run) == run / "final"
    return recipe, run


def test_ci_tiny_end_to_end(full_run):
    recipe, run = full_run
    records = metrics(run)
    assert [r["step"] for r in records] == list(range(1, recipe.optim.total_steps + 1))
    assert all(len(r["acc"]) == recipe.ttt.steps and 1 <= r["tau"] <= 1 + recipe.ttt.steps for r in records)
    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")] == ["step_2", "step_4", "step_6", "step_8"]
    target = build_random_target(recipe.model.random_target)
    head = load_draft_head(run / "final", target)
    assert head.config.draft_vocab_size == recipe.model.draft_vocab_size
    assert head.config.vocab_size == target.config.vocab_size
    speculators = load_draft_head(run / "final-speculators", target)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, speculators.state_dict()[name]), name


def test_resume_is_exact(full_run, tmp_path, monkeypatch):
    """Resumed from its checkpoint, which holds the draft vocabulary (the run does not count it again), a run ends
    as the uninterrupted one did."""
    recipe, run = full_run
    stopped = train(load_recipe("ci-tiny", QUIET + ["checkpoint.stop_after=3"]), tmp_path)
    assert stopped is None and not (tmp_path / "final").exists()
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "checkpoints")] == ["step_2"]

    with monkeypatch.context() as patch:
        patch.setattr(train_data, "draft_vocab", lambda *a: pytest.fail("counted a vocabulary the checkpoint holds"))
        assert train(load_recipe("ci-tiny", QUIET), tmp_path) == tmp_path / "final"  # resumes from step_2
    assert metrics(tmp_path) == metrics(run)  # step 3 is redone; every number matches
    want, got = load_file(run / "final" / "model.safetensors"), load_file(tmp_path / "final" / "model.safetensors")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_a_finished_run_trained_further_takes_the_recipes_lr_from_its_first_step(full_run, tmp_path):
    """A finished run (cosine down to min_lr 0) resumed with a larger optim.total_steps: each new step's lr is the
    recipe's schedule's (the checkpoint's optimizer held the old schedule's 0). The last step, 11, is not a multiple
    of checkpoint.every but is checkpointed all the same, so a failed export is redone without training again."""
    recipe, run = full_run
    shutil.copytree(run, tmp_path, dirs_exist_ok=True)
    longer = load_recipe("ci-tiny", QUIET + ["optim.total_steps=11"])
    assert train(longer, tmp_path) == tmp_path / "final"
    o, min_ratio = longer.optim, longer.optim.min_lr / longer.optim.lr
    lrs = {r["step"]: r["lr"] for r in metrics(tmp_path) if r.get("split") == "train"}
    assert lr_factor(8, o.warmup_steps, recipe.optim.total_steps, min_ratio) == 0  # the old schedule's at step 9
    for step in (9, 10, 11):
        assert lrs[step] == pytest.approx(o.lr * lr_factor(step - 1, o.warmup_steps, o.total_steps, min_ratio)), step
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "checkpoints")][-2:] == ["step_10", "step_11"]


def test_zero3_matches_zero1(full_run, tmp_path):
    """ZeRO-3, stopped after step 3 and resumed from its step-2 checkpoint: the losses and accuracies of the
    uninterrupted ZeRO-1 run, and its head, gathered whole for export."""
    recipe, run = full_run
    assert train(load_recipe("ci-tiny", QUIET + ZERO3 + ["checkpoint.stop_after=3"]), tmp_path) is None
    assert train(load_recipe("ci-tiny", QUIET + ZERO3), tmp_path) == tmp_path / "final"
    want, got = metrics(run), metrics(tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["acc"] == pytest.approx(a["acc"], abs=1e-6)
    target = build_random_target(recipe.model.random_target)
    zero1, zero3 = load_draft_head(run / "final", target), load_draft_head(tmp_path / "final", target)
    for name, tensor in zero1.state_dict().items():
        torch.testing.assert_close(zero3.state_dict()[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_init_from_trains_an_earlier_head_further(full_run, tmp_path, monkeypatch):
    """At lr 0 the continued head is exported as it was loaded: its weights and its draft vocabulary, not the one
    counted on this run's data (shifted here by another data seed), which is not even counted."""
    recipe, run = full_run
    more = ["optim.lr=0", "optim.min_lr=0", "optim.total_steps=2", "data.synthetic.seed=5"]
    with monkeypatch.context() as patch:
        patch.setattr(train_data, "draft_vocab", lambda *a: pytest.fail("counted a vocabulary init_from replaces"))
        assert train(load_recipe("ci-tiny", QUIET + more + [f"model.init_from={run / 'final'}"]), tmp_path)
    want, got = load_file(run / "final" / "model.safetensors"), load_file(tmp_path / "final" / "model.safetensors")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    fresh = train(load_recipe("ci-tiny", QUIET + more), tmp_path / "fresh")
    assert not torch.equal(load_file(fresh / "model.safetensors")["d2t"], want["d2t"])


def test_a_resumed_init_from_run_needs_no_init_from(full_run, tmp_path):
    """Stopped after its step-2 checkpoint, the run resumes from it alone: the head it started from is gone."""
    _, run = full_run
    start = tmp_path / "start"
    shutil.copytree(run / "final", start)
    recipe = load_recipe("ci-tiny", QUIET + [f"model.init_from={start}"])
    assert train(load_recipe("ci-tiny", QUIET + [f"model.init_from={start}", "checkpoint.stop_after=2"]),
                 tmp_path / "run") is None
    shutil.rmtree(start)
    assert train(recipe, tmp_path / "run") == tmp_path / "run" / "final"
    assert [r["step"] for r in metrics(tmp_path / "run")] == list(range(1, recipe.optim.total_steps + 1))


def test_init_from_refuses_a_head_of_another_shape(full_run, tmp_path):
    _, run = full_run
    recipe = load_recipe("ci-tiny", QUIET + [f"model.init_from={run / 'final'}", "model.draft_vocab_size=100"])
    with pytest.raises(ConfigError, match=r"model.init_from .*draft_vocab_size \d+ \(recipe: 100\)"):
        train(recipe, tmp_path)


def test_an_output_that_cannot_take_the_run_is_refused_before_anything_loads(full_run, tmp_path):
    """A finished run no checkpoint resumes would be trained again from step 0 and its head, recipe and metrics
    replaced; an output that is a file, hidden states never dumped and wandb not installed failed after the target
    loaded (minutes on a large one), in a traceback."""
    _, run = full_run
    finished = tmp_path / "finished"
    shutil.copytree(run / "final", finished / "final")
    (finished / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "file").write_text("")
    cases = [(finished, [], "holds a finished run (final/) and no checkpoint to resume"),
             (tmp_path / "file", [], "a file, not a run directory"),
             (tmp_path / "a", [f"data.hidden_states={tmp_path / 'states'}"], "no index.json; dump the hidden states"),
             (tmp_path / "b", ["logging.wandb_project=x"], "wandb is not installed")]
    for output, overrides, words in cases[:3] + cases[3:] * (importlib.util.find_spec("wandb") is None):
        with pytest.raises(ConfigError, match=re.escape(words)):
            train(load_recipe("ci-tiny", QUIET + overrides), output)
    assert (finished / "metrics.jsonl").read_text() == "{}\n" and not (tmp_path / "a").exists()


def test_the_speculators_verifier_is_the_target_s_class(tmp_path):
    """A HF directory names its classes in config.json; a GGUF file has none, so its family's class stands in (the
    packaged Qwen2 GGUF is not a Llama)."""
    fields = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 64}
    qwen2 = TargetConfig.from_hf({"model_type": "qwen2", **fields})
    gguf = tmp_path / "coder.gguf"
    gguf.write_bytes(b"GGUF")
    assert trainer._verifier_architectures(ModelConfig(target=str(gguf)), qwen2) == ["Qwen2ForCausalLM"]
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2Custom"], **fields}))
    assert trainer._verifier_architectures(ModelConfig(target=str(folder)), qwen2) == ["Qwen2Custom"]
    llama = TargetConfig.from_hf({"model_type": "llama", **fields})
    assert trainer._verifier_architectures(ModelConfig(random_arch="tiny"), llama) == ["LlamaForCausalLM"]


def test_deepspeed_extra_merges_into_sections():
    zero = deepspeed_config(load_recipe("ci-tiny", ZERO3), micro_batch_size=2, bf16=False)["zero_optimization"]
    assert zero == {"stage": 3, "memory_efficient_linear": False, "stage3_param_persistence_threshold": 0}


def test_loss_falls_on_an_overfit(tmp_path):
    recipe = load_recipe("ci-tiny", QUIET + [
        "data.synthetic.num_batches=1", "optim.grad_accum=1", "optim.total_steps=15", "optim.warmup_steps=0",
        "optim.lr=1e-2", "checkpoint.every=0",
    ])
    train(recipe, tmp_path)
    records = metrics(tmp_path)
    # Soft labels: the loss falls towards the target's (decayed) entropy, ~8.5 here, not to 0.
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 2 and losses[-1] < min(losses[:-1]) + 1e-3
    assert records[-1]["acc"][0] > 0.6 and records[-1]["tau"] > 2.5


@pytest.mark.parametrize("overrides, words", [
    (["data.synthetic.batch_size=3"], "data.synthetic: {'num_batches': 4, 'batch_size': 2"),
    (["seed=1"], "seed: 0 then, 1 now"),
    (["optim.total_steps=5"], "step_8: step 8 is past optim.total_steps 5"),
    (["checkpoint.resume=false"], "holds step_8 of an earlier run and checkpoint.resume is false"),
])
def test_a_checkpoint_resumes_only_where_its_position_means_the_same_rows(full_run, tmp_path, overrides, words):
    """Refused before anything loads, naming what changed."""
    _, run = full_run
    shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
    with pytest.raises(ConfigError) as refused:
        train(load_recipe("ci-tiny", QUIET + overrides), tmp_path)
    assert words in str(refused.value) and not (tmp_path / "metrics.jsonl").exists()


def test_aux_layers_set_to_the_default_are_left_implicit():
    """The exported config names aux layers only where they differ from [2, L//2, L-3]: engines disagree on what an
    explicit list means, and all agree on the default."""
    target = architecture_config("smollm2-135m")
    default = list(target.default_aux_layers)  # [2, 15, 27]
    assert trainer.head_config(load_recipe("ci-tiny", [f"model.aux_layers={default}"]).model, target).aux_layers is None
    other = load_recipe("ci-tiny", ["model.aux_layers=[2, 3, 4]"]).model
    assert trainer.head_config(other, target).aux_layers == (2, 3, 4)


def test_padding_and_the_dump_directory_do_not_change_what_a_position_means():
    """Padding changes no row, and a moved dump (or offline against online) holds rows checked by their digest."""
    base = trainer._data_order(load_recipe("ci-tiny"), 1)
    assert trainer._data_order(load_recipe("ci-tiny", ["data.pad_multiple=8", "data.hidden_states=/moved"]), 1) == base
    assert trainer._data_order(load_recipe("ci-tiny", ["data.synthetic.seed=3"]), 1) != base


@pytest.mark.parametrize("overrides, words", [
    (["model.draft_vocab_size=32"], "holds another head (draft_vocab_size: 64 then, 32 now"),
    (["model.aux_layers=[2, 3, 4]"], "holds another head (aux_layers: [2, 2, 1] then, [2, 3, 4] now"),
    (["model.precision=bf16"], "holds another head (precision: 'float32' then, 'bfloat16' now"),
    # A target of the same shape (a base model for its instruct one): the head would train on from other states.
    (["model.random_target.seed=1"], "holds another head (target: {'model_type': 'llama', 'hash': "),
    (["optim.lr=1e-3"], "holds optimizer states of other settings (optim.lr: 0.003 then, 0.001 now"),
    (["optim.betas=[0.8, 0.9]"], "holds optimizer states of other settings (optim.betas: [0.9, 0.95] then, "
                                 "[0.8, 0.9] now"),
    (["optim.weight_decay=0.1"], "holds optimizer states of other settings (optim.weight_decay: 0.0 then, 0.1 now"),
    # DeepSpeed fails on another stage's files, with errors that do not say so.
    (["deepspeed.zero_stage=3"], "holds optimizer states of other settings (deepspeed.zero_stage: 1 then, 3 now"),
])
def test_a_checkpoint_resumes_only_into_the_head_and_optimizer_it_holds(full_run, tmp_path, overrides, words):
    """Another head shape, fused layers, precision or target is refused by name before the checkpoint loads (a head of
    other layers would train on silently; one of another shape failed inside DeepSpeed's load); so is another lr,
    betas or weight decay, which loading the checkpoint's optimizer states would silently put back, or ZeRO stage."""
    _, run = full_run
    shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
    with pytest.raises(ConfigError) as refused:
        train(load_recipe("ci-tiny", QUIET + overrides), tmp_path)
    assert f"step_8 {words}" in str(refused.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_durable_replace_flushes_everything_then_swaps(tmp_path, monkeypatch):
    """Every file and directory of the new checkpoint reaches the disk before the rename, the renames after it; the
    old directory of the same name is replaced whole."""
    final, tmp = tmp_path / "step_4", tmp_path / ".step_4.tmp"
    final.mkdir()
    (final / "stale.pt").write_text("old")
    (tmp / "engine").mkdir(parents=True)
    (tmp / "engine" / "weights.pt").write_text("new")
    (tmp / "trainer_state.json").write_text("{}")
    flushed, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: flushed.append(Path(os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd))
    checkpoint.durable_replace(tmp, final)
    assert sorted(p.relative_to(final).as_posix() for p in final.rglob("*")) == [
        "engine", "engine/weights.pt", "trainer_state.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["step_4"]  # neither the tmp nor the old one is left
    assert set(flushed[:-1]) == {tmp / "engine", tmp / "engine" / "weights.pt", tmp / "trainer_state.json", tmp}
    assert flushed[-1] == tmp_path  # the directory that holds the renames, after them


def test_incomplete_checkpoints_are_ignored(tmp_path):
    for name in ("step_2", "step_10", ".step_12.tmp", "step_11"):
        (tmp_path / name).mkdir()
    for name in ("step_2", "step_10", ".step_12.tmp"):
        (tmp_path / name / "trainer_state.json").write_text("{}")
    assert checkpoint.checkpoints(tmp_path) == [tmp_path / "step_2", tmp_path / "step_10"]


def test_a_save_deletes_what_saves_cut_short_left(tmp_path):
    """A `.step_N.tmp` (or `durable_replace`'s `.step_N.old`) of a save killed mid-way holds up to a whole optimizer
    state; when step N is never saved again, the next save deletes it, and nothing else."""
    for name in (".step_3.tmp/engine", ".step_5.old/engine", "step_2", ".final.tmp"):
        (tmp_path / name).mkdir(parents=True)
    engine = types.SimpleNamespace(save_checkpoint=lambda path, tag, save_latest: (Path(path) / tag).mkdir())
    checkpoint.save(engine, tmp_path, step=4, position=8, records={})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".final.tmp", "step_2", "step_4"]


def test_records_compare_the_settings_both_hold():
    """A setting one eyas records and another does not (added or dropped since) does not refuse a resume."""
    assert checkpoint._changes({"optim.lr": 1.0, "data.pad_multiple": 8}, {"optim.lr": 1.0, "zero": 2}) == ""
    assert checkpoint._changes({"optim.lr": 1.0}, {"optim.lr": 2.0, "zero": 2}) == "optim.lr: 1.0 then, 2.0 now"


def test_pruning_moves_a_checkpoint_out_of_sight_before_deleting_it(tmp_path, monkeypatch):
    """A kill mid-delete must not leave a `step_N` that `checkpoints` no longer lists (its trainer_state.json gone)
    and no save ever deletes: the prune renames it to a `.step_N.old`, which the next save or start deletes."""
    engine = types.SimpleNamespace(save_checkpoint=lambda path, tag, save_latest: (Path(path) / tag).mkdir())
    checkpoint.save(engine, tmp_path, step=2, position=2, records={})
    deleted = []
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda path, **kw: Path(path).exists() and deleted.append(
        Path(path).name))  # durable_replace clears a `.step_4.old` that is not there
    checkpoint.save(engine, tmp_path, step=4, position=4, records={}, keep_last=1)
    assert deleted == [".step_2.old"] and sorted(p.name for p in tmp_path.iterdir()) == [".step_2.old", "step_4"]
    monkeypatch.undo()
    checkpoint.remove_partial(tmp_path)  # what the killed prune left, gone at the next start
    assert [p.name for p in tmp_path.iterdir()] == ["step_4"]


def test_a_save_that_fails_names_the_checkpoint_kept(tmp_path):
    """A full disk reaches torch as 'unexpected pos ...': the error says which save failed, the room left and the
    checkpoint a rerun resumes from."""
    engine = types.SimpleNamespace(save_checkpoint=lambda path, tag, save_latest: (Path(path) / tag).mkdir())
    checkpoint.save(engine, tmp_path, step=2, position=2, records={})

    def full(path, tag, save_latest):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 250048 vs 249936")

    with pytest.raises(RuntimeError, match=r"saving step_4 into .*\.step_4\.tmp failed \(.*unexpected pos.*\); "
                       r"[\d.]+ GiB free there\. step_2 is the last one kept"):
        checkpoint.save(types.SimpleNamespace(save_checkpoint=full), tmp_path, step=4, position=4, records={})

def test_a_run_that_saves_no_more_deletes_what_a_save_cut_short_left(tmp_path):
    """A run without periodic checkpoints killed while saving the one a SIGTERM asked for, then rerun: it never saves,
    and deletes the leftover at its start."""
    (tmp_path / "checkpoints" / ".step_5.tmp" / "engine").mkdir(parents=True)
    assert train(load_recipe("ci-tiny", [*QUIET, "checkpoint.every=0"]), tmp_path) == tmp_path / "final"
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_lr_schedule():
    got = [lr_factor(s, warmup=2, total=6, min_ratio=0.0) for s in range(6)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.8536, 0.5, 0.1464], abs=1e-4)
    assert lr_factor(5, 0, 5, 0.1) == pytest.approx(0.1)


def _start_train_eagle(run: Path, overrides: list[str]) -> subprocess.Popen:
    """`train-eagle --recipe ci-tiny --output run` in a child process; its stdout and stderr go to `run`.log."""
    command = [sys.executable, "-m", "eyas.train.cli", "--recipe", "ci-tiny", "--output", str(run)]
    for item in overrides:
        command += ["--set", item]
    with open(run.with_suffix(".log"), "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=launcher_free_env())


def _wait_until(condition, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the run ended (or stalled) before it was interrupted:\n" + log.read_text())
        time.sleep(0.02)


def _assert_resumes_to_an_uninterrupted_run(run: Path, whole: Path, overrides: list[str]) -> None:
    """Rerunning the interrupted `run` (in-process) finishes with the weights and metrics of an uninterrupted
    run into `whole`."""
    recipe = load_recipe("ci-tiny", overrides)
    assert train(recipe, run) == run / "final"
    assert train(recipe, whole) == whole / "final"
    want, got = load_file(whole / "final/model.safetensors"), load_file(run / "final/model.safetensors")
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert metrics(run) == metrics(whole)


@pytest.mark.parametrize("offline", [False, True], ids=["online", "offline"])
def test_sigkill_mid_run_resumes_to_the_same_weights(tmp_path, offline):
    """A `train-eagle` process killed with SIGKILL (no chance to clean up) after a checkpoint: rerunning the
    same command finishes with the weights of an uninterrupted run."""
    overrides = QUIET + ["optim.total_steps=60", "optim.warmup_steps=5", "checkpoint.every=5"]
    if offline:
        overrides.append(f"data.hidden_states={tmp_path / 'states'}")
        dump(load_recipe("ci-tiny", overrides))
    process = _start_train_eagle(tmp_path / "killed", overrides)
    _wait_until((tmp_path / "killed/checkpoints/step_10").exists, process, tmp_path / "killed.log")
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not (tmp_path / "killed/final").exists(), "killed too late: the run had finished"
    _assert_resumes_to_an_uninterrupted_run(tmp_path / "killed", tmp_path / "whole", overrides)


def test_sigterm_checkpoints_the_step_in_progress_and_resumes_to_the_same_weights(tmp_path):
    """SIGTERM (preemption, `timeout`) mid-run: `train-eagle` finishes its step, checkpoints it although no periodic
    checkpoint is due, says so and exits as SIGTERM would have (143: a retry loop reruns it); rerunning the same
    command resumes there to the weights of an uninterrupted run, and the in-process runs leave the signal handlers as
    they found them."""
    overrides = QUIET + ["optim.total_steps=60", "optim.warmup_steps=5", "checkpoint.every=1000"]
    run, log = tmp_path / "stopped", tmp_path / "stopped.log"
    process = _start_train_eagle(run, overrides)
    jsonl = run / "metrics.jsonl"
    _wait_until(lambda: jsonl.exists() and jsonl.read_text().count("\n") >= 3, process, log)
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError("SIGTERM did not stop the run:\n" + log.read_text()) from None
    last = metrics(run)[-1]["step"]
    assert 3 <= last < 60 and not (run / "final").exists()
    assert [p.name for p in checkpoint.checkpoints(run / "checkpoints")] == [f"step_{last}"]
    saved = run / "checkpoints" / f"step_{last}"
    assert (f"train-eagle: stopped by SIGTERM at step {last}; checkpoint saved to {saved}; rerun the same command to "
            "resume") in log.read_text()

    handlers = [signal.getsignal(s) for s in StopSignal.SIGNALS]
    _assert_resumes_to_an_uninterrupted_run(run, tmp_path / "whole", overrides)
    assert [signal.getsignal(s) for s in StopSignal.SIGNALS] == handlers


def test_stop_signal_records_signals_and_lets_a_second_ctrl_c_kill():
    # Python's own Ctrl-C handler, as in a foreground process (a shell's background job starts with SIGINT ignored,
    # which StopSignal leaves so).
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignal() as stop:
            signal.raise_signal(signal.SIGINT)  # a KeyboardInterrupt here would mean no handler was installed
            assert stop.name == "SIGINT"
            assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # Ctrl-C again kills
            signal.raise_signal(signal.SIGTERM)  # what a launcher forwards: still only recorded (else it would kill)
            assert stop.name == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outside)


def test_stop_signal_leaves_an_ignored_sigint_ignored():
    outside = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignal() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.name is None and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, outside)


@pytest.mark.parametrize("precision, slowdown, warned", [("bf16", 50.0, True), ("bf16", 1.5, False),
                                                         ("fp32", 50.0, False), ("auto", 50.0, False)])
def test_bf16_on_a_cpu_without_bf16_instructions_is_flagged(monkeypatch, capsys, precision, slowdown, warned):
    """bf16 matmuls on a CPU without bf16 instructions run 50-60 times slower than fp32 ones: asked for, bf16 is
    used and the run says so (auto is fp32 on a CPU)."""
    recipe = load_recipe("ci-tiny", [f"model.precision={precision}"])
    monkeypatch.setattr(trainer, "_bf16_slowdown", lambda: slowdown)
    dtype = trainer._dtype(recipe.model, torch.device("cpu"))
    assert dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    assert ("model.precision=fp32 trains faster" in capsys.readouterr().out) == warned


@pytest.mark.parametrize("run", ["train", "dump"])
def test_a_run_reads_a_gguf_target_s_config_weights_and_tokenizer_from_one_parse(run, monkeypatch, tmp_path):
    """transformers parses a GGUF file for its config, its tensors and its tokenizer: a run on a GGUF target reads
    all three (the config in `check_inputs`, the weights in `load_target`, the tokenizer in `load_rows`) within one
    `gguf_parsed_once`, and so parses the file once (tests/common/test_gguf.py)."""
    gguf = pytest.importorskip("gguf")
    from tests.gguf_files import write_gguf

    path = write_gguf(tmp_path / "target.gguf")  # two layers
    parsed, shared = [], []
    made = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: parsed.append(args[0]) or made(*args, **kwargs))

    def recording(function, stop=False):
        def call(*args, **kwargs):
            shared.append(getattr(gguf.GGUFReader, "shared", False))
            if stop:
                raise KeyboardInterrupt  # the config and weights read: far enough
            return function(*args, **kwargs)
        return call

    for name in ("check_inputs", "load_target"):
        monkeypatch.setattr(trainer, name, recording(getattr(trainer, name)))
    monkeypatch.setattr(trainer, "load_rows", recording(trainer.load_rows, stop=True))
    dumps = [f"data.hidden_states={tmp_path / 'states'}"] if run == "dump" else []  # train reads none: none dumped
    target = ["model.random_target=null", f"model.target={path}", "model.draft_vocab_size=16",
              "model.aux_layers=[0,1,1]"]
    recipe = load_recipe("ci-tiny", QUIET + dumps + target)
    with pytest.raises(KeyboardInterrupt):
        train(recipe, tmp_path / "run") if run == "train" else dump(recipe)
    assert shared == [True, True, True] and parsed == [path]
    assert not getattr(gguf.GGUFReader, "shared", False)  # let go after the run
