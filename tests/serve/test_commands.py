"""The shared command-line pieces: a wrong draft head fails before the target loads; the loaders' input errors are
usage errors, and so are the engine's refusals of its settings, and only they."""

import argparse
import re

import pytest

from eyas.common.target import TargetModel
from eyas.serve import cli, commands, evaluate
from eyas.serve.commands import load_models, load_models_for


@pytest.mark.parametrize("exists, reason", [(True, "no config.json"), (False, "no such directory")])
def test_a_wrong_draft_fails_before_the_target_loads(tmp_path, monkeypatch, exists, reason):
    draft = tmp_path / "head"
    if exists:
        draft.mkdir()
    loaded = []
    monkeypatch.setattr(TargetModel, "from_pretrained", lambda *args, **kwargs: loaded.append(args))
    with pytest.raises(FileNotFoundError, match=re.escape(f"draft head {draft}: {reason}")):
        load_models(tmp_path, draft)
    assert not loaded


def test_a_target_without_a_tokenizer_or_a_gguf_transformers_refuses_is_a_usage_error_naming_it(
        hf_checkpoint, tmp_path, capsys):
    """transformers' own messages name no file (a directory without tokenizer files, a GGUF architecture it does not
    read) or gguf's ("GGUF magic invalid"); the loaders' errors name it, and the command stops with a usage error, not
    a traceback."""
    pytest.importorskip("gguf")
    from tests.gguf_files import write_gguf

    target, _ = hf_checkpoint("llama")  # saved without a tokenizer
    corrupt = tmp_path / "model.gguf"
    corrupt.write_bytes(b"not a gguf file")
    other = write_gguf(tmp_path / "other.gguf", arch="eyasnet")
    for path, words in ((target, f"{target}: no tokenizer loads from it"),
                        (corrupt, f"{corrupt}: not a readable GGUF file"),
                        (other, f"{other}: GGUF model with architecture eyasnet is not supported")):
        with pytest.raises(SystemExit) as stopped:
            load_models_for(argparse.ArgumentParser(), path)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("load", [
    lambda path: load_models_for(argparse.ArgumentParser(), path),
    lambda path: cli.main(["--target", str(path), "--speculative", "off", "--device", "cpu"]),
], ids=["load_models_for", "serve-eagle"])
def test_an_error_of_eyas_own_while_loading_keeps_its_traceback(tmp_path, monkeypatch, load):
    """Only the loaders' input errors are usage errors: a ValueError from a bug propagates as itself."""
    monkeypatch.setattr(TargetModel, "from_pretrained", _a_bug)
    with pytest.raises(ValueError, match="a bug"):
        load(tmp_path)


@pytest.mark.parametrize("run", [
    lambda questions: cli.main(["--target", "t", "--speculative", "off", "--device", "cpu"]),
    lambda questions: evaluate.main(["--target", "t", "--draft", "d", "--bench", str(questions), "--device", "cpu"]),
], ids=["serve-eagle", "eval-eagle"])
def test_an_error_of_eyas_own_while_building_the_engine_keeps_its_traceback(tmp_path, monkeypatch, run):
    """Only the engine's refusals of its settings (ConfigError) are usage errors: a ValueError from a bug inside
    Engine propagates as itself."""
    import torch

    from eyas.common.architectures import random_target

    target = random_target("tiny", torch.float32, "cpu")
    for module in (commands, cli):  # each command's own name for the loader
        monkeypatch.setattr(module, "load_models", lambda *args: (target, None, None, tmp_path))
    for module in (cli, evaluate):
        monkeypatch.setattr(module, "Engine", _a_bug)
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"prompt": "Hi"}\n')
    with pytest.raises(ValueError, match="a bug"):
        run(questions)


def _a_bug(*args, **kwargs):
    raise ValueError("a bug, not the user's input")
