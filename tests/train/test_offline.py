"""Offline training (`data.hidden_states`): `dump` writes the target's states over a recipe's rows; training from
them logs the losses of training on the target's forward, loading only the target's embedding, final norm and
lm_head; states dumped for other rows are refused."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.common.checkpoint import CheckpointError
from eyas.common.target import TargetModel
from eyas.data.hidden_states import HiddenStateDataset
from eyas.train import target as train_target
from eyas.train.cli import main as cli_main
from eyas.train.config import ModelConfig, load_recipe
from eyas.train.data import load_data, load_rows
from eyas.train.target import load_target
from eyas.train.trainer import dump, train
from tests.train import metrics

QUIET = ["logging.progress=false"]


def load_target_ends(path) -> TargetModel:
    return load_target(ModelConfig(target=str(path)), torch.float32, torch.device("cpu"), layers=False)


def test_target_ends(hf_checkpoint):
    path, hf = hf_checkpoint("llama")
    ends = load_target_ends(path)
    state = hf.state_dict()
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(ends.state_dict()[name], state[name]), name
    assert all(p.is_meta for p in ends.model.layers.parameters())


def test_target_ends_of_a_tied_target(hf_checkpoint):
    """A tied target (qwen2 here) has no lm_head of its own: its logits come from the embedding."""
    path, hf = hf_checkpoint("qwen2")
    ends = load_target_ends(path)
    assert ends.lm_head is None
    assert torch.equal(ends.lm_head_weight, hf.state_dict()["model.embed_tokens.weight"])
    assert torch.equal(ends.model.norm.weight, hf.state_dict()["model.norm.weight"])
    assert all(p.is_meta for p in ends.model.layers.parameters())


def test_target_ends_refuse_a_misshaped_tensor(hf_checkpoint, tmp_path):
    """Loaded through the strict loader: the error names the checkpoint and the tensor, not torch's copy error."""
    path = hf_checkpoint("llama")[0]
    for f in path.iterdir():
        shutil.copy(f, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1].clone()  # [256, 64], the config says vocab 257
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_target_ends(tmp_path)
    assert str(tmp_path) in str(err.value)
    assert "tensor 'lm_head.weight' has shape (256, 64), expected (257, 64)" in str(err.value)


def test_offline_training_matches_online(hf_checkpoint, tmp_path, monkeypatch):
    """ci-tiny on a saved Llama checkpoint, 4 steps: per-step losses and accuracies agree (the dump ran the target
    row by row, the online trainer two rows at a time: their states may differ in the last bits)."""
    path = hf_checkpoint("llama")[0]
    overrides = QUIET + ["model.random_target=null", f"model.target={path}", "optim.total_steps=4",
                         "checkpoint.every=0"]
    train(load_recipe("ci-tiny", overrides), tmp_path / "online")

    recipe = load_recipe("ci-tiny", overrides + [f"data.hidden_states={tmp_path / 'states'}"])
    dump(recipe)

    load_checkpoint = train_target.load_checkpoint

    def ends_only(path, dtype, device, only=None):
        assert only is not None, "offline training loaded the whole target"
        return load_checkpoint(path, dtype, device, only)

    monkeypatch.setattr(train_target, "load_checkpoint", ends_only)
    train(recipe, tmp_path / "offline")
    online, offline = metrics(tmp_path / "online"), metrics(tmp_path / "offline")
    assert [r["step"] for r in offline] == [r["step"] for r in online] == [1, 2, 3, 4]
    for want, got in zip(online, offline, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (want, got)
        assert got["acc"] == pytest.approx(want["acc"], abs=1e-6) and got["tokens"] == want["tokens"]


def test_states_of_other_rows_are_refused(tmp_path):
    recipe = load_recipe("ci-tiny", [f"data.hidden_states={tmp_path}"])
    dump(recipe)
    target = load_target(recipe.model, torch.float32, torch.device("cpu"))
    states = HiddenStateDataset(tmp_path, target, target.config.default_aux_layers)
    for overrides, message in [
        (["data.synthetic.num_batches=5"], "holds the first 8 of the recipe's 10 rows; finish the dump"),
        (["data.synthetic.seq_len=16"], "dumped from other data"),
        (["data.synthetic.seed=1"], r"shard_00000.safetensors holds other conversations than rows 0\.\.7 of this data"),
    ]:
        other = load_recipe("ci-tiny", overrides)
        with pytest.raises(ValueError, match=message):
            load_data(other.data, load_rows(other, 256), 256, 64, seed=0, states=states)


def test_cli_names_states_of_another_target(tmp_path, capsys):
    """States dumped from another target are refused by train-eagle as a usage error, the dump named, without a
    traceback."""
    dump(load_recipe("ci-tiny", [f"data.hidden_states={tmp_path / 'states'}"]))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--recipe", "ci-tiny", "--output", str(tmp_path / "run"), "--set", "model.random_target.seed=1",
                  "--set", f"data.hidden_states={tmp_path / 'states'}"])
    assert exit_info.value.code == 2
    assert f"{tmp_path / 'states'}: hidden states were dumped with target=" in capsys.readouterr().err


def test_dump_refuses_an_output_it_would_not_write(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--recipe", "ci-tiny", "--dump-hidden-states", "--output", str(tmp_path / "run")])
    assert exit_info.value.code == 2 and "--output would be ignored" in capsys.readouterr().err


def test_dump_needs_a_directory():
    with pytest.raises(ValueError, match="data.hidden_states"):
        dump(load_recipe("ci-tiny"))
