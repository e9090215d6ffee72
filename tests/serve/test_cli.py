"""serve-eagle's arguments: serving recipes map onto its flags, flags given override them, unknown keys fail; the
sampling flags every tool shares are checked before anything loads."""

import gc
from pathlib import Path

import pytest

from eyas.serve import bench, chat, cli, evaluate, profile, regenerate
from eyas.serve.cli import SERVE_RECIPES, model_name, parse_args


@pytest.mark.parametrize("recipe", sorted(p.stem for p in SERVE_RECIPES.glob("*.yaml")))
def test_every_serving_recipe_loads(recipe):
    args = parse_args(["--recipe", recipe])
    assert args.tree.num_draft_tokens >= 2


def test_flags_override_the_recipe():
    args = parse_args(["--recipe", "smollm2-135m", "--port", "9100", "--topk", "2", "--num-draft-tokens", "8"])
    assert (args.port, args.tree.num_steps, args.tree.topk, args.tree.num_draft_tokens) == (9100, 5, 2, 8)
    assert str(args.draft) == "runs/quickstart/final"


@pytest.mark.parametrize("text, words", [("target: x\nnum_stepz: 3\n", "unknown key 'num_stepz'"),
                                         ("disable_cuda_graph: 1\n", "disable_cuda_graph is true or false, got 1"),
                                         ("dtype:\n", "bad.yaml: dtype has no value"),
                                         ("num_steps: five\n", "bad.yaml: num_steps: 'five' is not a valid value"),
                                         ("dtype: float64\n", "bad.yaml: dtype: 'float64' is not one of"),
                                         ("port: [8000, 8001]\n", "bad.yaml: port: [8000, 8001] is not a valid"),
                                         ("target: [x\n", "bad.yaml: not valid YAML"),
                                         (b"target: caf\xe9\n", "bad.yaml: not valid YAML")])
def test_bad_recipe_key_is_named(tmp_path, capsys, text, words):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(text) if isinstance(text, bytes) else bad.write_text(text)
    with pytest.raises(SystemExit):
        parse_args(["--recipe", str(bad)])
    assert words in capsys.readouterr().err


def test_a_directory_named_like_a_recipe_is_not_read_as_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m").mkdir()  # say, a downloaded model
    assert parse_args(["--recipe", "smollm2-135m"]).tree.num_steps == 5


def test_the_served_name_of_the_current_directory_is_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert model_name(".", Path(".")) == model_name(str(tmp_path), tmp_path) == tmp_path.name


@pytest.mark.parametrize("line, graphs, speculative", [("disable_cuda_graph: true", True, "on"),
                                                       ("disable_cuda_graph: false", False, "on"),
                                                       ("speculative: off", False, "off")])
def test_recipe_switches_and_on_off(tmp_path, line, graphs, speculative):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: smollm2-135m-instruct\ndraft: {tmp_path}\n{line}\n")
    args = parse_args(["--recipe", str(recipe)])
    assert (args.disable_cuda_graph, args.speculative) == (graphs, speculative)


@pytest.mark.parametrize("flags, overlap, graphs, fp8", [([], True, True, False),
                                                         (["--disable-overlap"], False, True, False),
                                                         (["--disable-cuda-graph"], True, False, False),
                                                         (["--draft-fp8"], True, True, True)])
def test_engine_switches_reach_the_engine(flags, overlap, graphs, fp8):
    config = parse_args(["--recipe", "smollm2-135m", *flags]).engine
    assert (config.overlap, config.cuda_graphs, config.draft_fp8) == (overlap, graphs, fp8)


def test_a_backend_the_device_cannot_run_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--recipe", "smollm2-135m", "--attention", "flashinfer", "--device", "cpu"])
    assert stopped.value.code == 2 and "--attention flashinfer: the flashinfer attention backend needs a CUDA" in (
        capsys.readouterr().err)


def test_autotune_file_is_read_and_checked(tmp_path, capsys):
    path = tmp_path / "autotune.json"
    path.write_text('{"best_setting_by_batch_size": {"1": "7,1,8", "32": "off"}}')
    args = parse_args(["--recipe", "smollm2-135m", "--autotune", str(path)])
    assert [(b, s and s.num_steps) for b, s in args.tree_by_batch] == [(1, 7), (32, None)]
    path.write_text('{"best_setting_by_batch_size": {"one": "off"}}')
    with pytest.raises(SystemExit):
        parse_args(["--recipe", "smollm2-135m", "--autotune", str(path)])
    assert "entry 'one'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [
    (["--speculative", "off", "--draft", "head"], "--speculative off serves the target alone: --draft would be"),
    (["--speculative", "off", "--token-map", "f.pt", "--autotune", "A"], "--token-map, --autotune would be ignored"),
    (["--speculative", "off", "--topk", "2", "--draft-fp8"], "--topk, --draft-fp8 would be ignored"),
    (["--autotune", "A", "--num-steps", "5", "--topk", "1"], "--autotune sets the tree per batch size: --num-steps, "
                                                              "--topk would be ignored"),
    (["--max-batch-size", "0"], "--max-batch-size must be at least 1, got 0"),
    (["--mem-fraction", "1.5"], "argument --mem-fraction: must be in (0, 1], got 1.5"),
    (["--mem-fraction", "half"], "argument --mem-fraction: 'half' is not a number"),
    (["--port", "-5"], "--port must be in [0, 65535], got -5"),  # bind() failed once the model had loaded
])
def test_flags_that_would_be_ignored_or_fail_later_are_usage_errors(tmp_path, capsys, flags, words):
    """Typed on the command line, before anything loads (the recipe's own tree and head are overridden by design)."""
    (tmp_path / "A").write_text('{"best_setting_by_batch_size": {"1": "7,1,8"}}')
    flags = [str(tmp_path / "A") if f == "A" else f for f in flags]
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--recipe", "smollm2-135m", *flags])
    assert stopped.value.code == 2 and words in capsys.readouterr().err


def test_a_recipe_s_head_and_tree_give_way_to_flags(tmp_path):
    (tmp_path / "A").write_text('{"best_setting_by_batch_size": {"1": "7,1,8"}}')
    assert parse_args(["--recipe", "smollm2-135m", "--speculative", "off"]).speculative == "off"
    args = parse_args(["--recipe", "smollm2-135m", "--autotune", str(tmp_path / "A")])
    assert args.tree_by_batch[0][1].num_steps == 7


def test_a_tree_the_loaded_head_cannot_draft_stops_the_server_by_name(monkeypatch, capsys):
    import torch

    from eyas.common.architectures import random_target
    from eyas.serve import cli
    from eyas.serve.bench import random_head

    target = random_target("tiny", torch.float32, "cpu")
    monkeypatch.setattr(cli, "load_models", lambda *args: (target, random_head(target, 4), None, Path("t")))
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--recipe", "smollm2-135m", "--num-steps", "3", "--topk", "8", "--num-draft-tokens", "8",
                  "--device", "cpu", "--draft", "head"])
    assert stopped.value.code == 2 and "serve-eagle: error: tree 3,8,8: topk 8 is more than the head's draft " \
        "vocabulary of 4 tokens" in capsys.readouterr().err


def test_impossible_tree_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--recipe", "smollm2-135m", "--topk", "2", "--num-draft-tokens", "99"])
    assert stopped.value.code == 2 and "--num-draft-tokens 99" in capsys.readouterr().err


@pytest.mark.parametrize("main, args", [
    (bench.main, ["--random-weights", "--arch", "tiny", "--device", "cpu"]),
    (profile.main, ["--arch", "tiny", "--device", "cpu"]),
    (evaluate.main, ["--target", "no-such-target", "--draft", "no-such-head", "--device", "cpu"]),
    (regenerate.main, ["--data", "no-such-data.json", "--output", "out.jsonl", "--target", "no-such-target"]),
], ids=["bench-eagle", "profile", "eval-eagle", "regenerate"])
@pytest.mark.parametrize("flags, words", [
    (["--temperature", "-1"], "--temperature: temperature must be a finite number"),
    (["--temperature", "0.7", "--top-p", "0"], "--top-p: top_p must be in (0, 1]"),
    (["--top-p", "0.5"], "sampled tokens: set --temperature above 0"),
], ids=["temperature", "top-p", "filter-when-greedy"])
def test_sampling_flags_are_usage_errors_before_anything_loads(main, args, flags, words, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(args + flags)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and words in err
    if "sampled tokens" in words:  # eval-eagle's --topk is the tree's: the message names no --top-k it lacks
        assert ("--top-k" in err.split("error:")[1]) == (main is not evaluate.main)


MISSING_TARGET = "target '/no/such/model' is neither an existing path nor a packaged model"


@pytest.mark.parametrize("main, args, words", [
    (cli.main, ["--speculative", "off"], MISSING_TARGET),
    (chat.main, ["Hi", "--device", "cpu"], MISSING_TARGET),
    (evaluate.main, ["--draft", "/no/such/head", "--device", "cpu"], "draft head /no/such/head: no such directory"),
], ids=["serve-eagle", "chat", "eval-eagle"])
def test_a_missing_model_is_named_without_a_traceback(main, args, words, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--target", "/no/such/model", *args])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and words in err and "Traceback" not in err


@pytest.mark.parametrize("main, args", [
    (chat.main, ["Hi"]),
    (evaluate.main, ["--draft", "{head}"]),
    (bench.main, ["--draft", "{head}"]),
], ids=["chat", "eval-eagle", "bench-eagle"])
def test_a_malformed_model_is_named_without_a_traceback(main, args, tmp_path, capsys):
    """A config field, a tensor or a head for another target: the loaders' ConfigError and CheckpointError name it;
    the commands showed them in a traceback."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target/config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "head").mkdir()
    (tmp_path / "head/config.json").write_text("{}")
    with pytest.raises(SystemExit) as stopped:
        main(["--target", str(tmp_path / "target"), "--device", "cpu",
              *(a.format(head=tmp_path / "head") for a in args)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "model_type 'gpt2' is not supported" in err and "Traceback" not in err


@pytest.mark.parametrize("main, args", [(cli.main, []), (chat.main, ["Hi"]), (evaluate.main, []), (bench.main, []),
                                        (profile.main, []), (regenerate.main, ["--output", "x.jsonl"])],
                         ids=["serve-eagle", "chat", "eval-eagle", "bench-eagle", "profile", "regenerate"])
@pytest.mark.parametrize("device, words", [
    ("gpu", "'gpu' is not a device: cpu, cuda or cuda:N"), ("cuda:64", "cuda:64: this machine has"),
    ("meta", "meta: eyas runs on cpu or cuda")])
def test_a_device_the_machine_lacks_is_a_usage_error_before_anything_loads(main, args, device, words, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([*args, "--device", device])
    assert stopped.value.code == 2 and f"argument --device: {words}" in capsys.readouterr().err


def test_the_server_runs_with_the_startup_heap_frozen_and_unfreezes_it(monkeypatch):
    import torch

    from eyas.common.architectures import random_target
    from eyas.serve import api

    target = random_target("tiny", torch.float32, "cpu")
    monkeypatch.setattr(cli, "load_models", lambda *args: (target, None, None, Path("t")))
    frozen_while_serving = []

    class Server:
        def __init__(self, app, worker, host, port):
            pass

        def run(self):
            frozen_while_serving.append(gc.get_freeze_count())
            raise KeyboardInterrupt  # as Ctrl-C ends serving

    monkeypatch.setattr(api, "GracefulServer", Server)
    monkeypatch.setattr(api, "create_app", lambda worker, tokenizer, name: None)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--speculative", "off", "--device", "cpu", "--target", "t"])
    assert stopped.value.code == 130
    assert frozen_while_serving[0] > 10_000 and gc.get_freeze_count() == 0
