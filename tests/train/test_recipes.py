"""Recipes: every file in recipes/ loads; unknown or mistyped keys and bad --set overrides are errors that
name the file and the dotted key (train-eagle prints them as usage errors, without a traceback); --set values
follow YAML rules (a list is a list); a bad `data.path` entry is named by its index."""

import pytest

from eyas.common.config import ConfigError
from eyas.train.cli import main
from eyas.train.config import RECIPES_DIR, Source, load_recipe, parse_scalar, recipe_path

RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))


def test_there_are_recipes():
    assert "ci-tiny" in [p.stem for p in RECIPES]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads(path):
    recipe = load_recipe(path)
    assert load_recipe(path.stem) == recipe


def test_scalars_follow_yaml():
    assert parse_scalar("3e-4") == 3e-4 and parse_scalar("-1.5E+2") == -150.0
    assert parse_scalar("7") == 7 and isinstance(parse_scalar("7"), int)
    assert parse_scalar("null") is None and parse_scalar("true") is True
    assert parse_scalar("[1, 2]") == [1, 2] and parse_scalar("abc") == "abc"


def test_set_overrides():
    recipe = load_recipe("ci-tiny", ["optim.lr=1e-2", "checkpoint.stop_after=3", "model.aux_layers=[2, 3, 4]",
                                     "deepspeed.zero_stage=2", "data.synthetic.seq_len=16"])
    assert recipe.optim.lr == 1e-2 and recipe.checkpoint.stop_after == 3
    assert recipe.model.aux_layers == [2, 3, 4] and recipe.deepspeed.zero_stage == 2
    assert recipe.data.synthetic.seq_len == 16
    assert isinstance(load_recipe("ci-tiny", ["optim.lr=1"]).optim.lr, float)


@pytest.mark.parametrize("overrides, words", [
    (["optim.lrr=1e-3"], ["ci-tiny.yaml", "optim.lrr"]),
    (["nope.x=1"], ["ci-tiny.yaml", "'nope'"]),
    (["data.synthetic.seq_lenn=4"], ["data.synthetic.seq_lenn"]),
    (["optim.lr=fast"], ["ci-tiny.yaml", "optim", "'lr'", "'fast'"]),
    (["ttt.steps=2.5"], ["ttt", "'steps'"]),
    (["checkpoint.every=true"], ["checkpoint", "'every'"]),
    (["ttt.steps=0"], ["ttt", "steps >= 1"]),
    (["ttt.decay=0"], ["ttt", "decay > 0"]),
    (["checkpoint.every=-1"], ["checkpoint", "every and keep_last >= 0"]),
    (["checkpoint.stop_after=0"], ["checkpoint", "stop_after >= 1 (or unset)"]),
    (["ttt.decay=.inf"], ["ttt", "a finite decay > 0"]),
    (["logging.eval_every=-5"], ["logging", "eval_every >= 0, got -5"]),
    (["deepspeed.zero_stage=4"], ["deepspeed", "zero_stage"]),
    (["optim.lr"], ["--set", "optim.lr", "KEY=VALUE"]),
    (["optim.lr.x=1"], ["--set", "'optim.lr' is not a section"]),
    (["optim=3"], ["'optim' should be a mapping"]),
    (["optim.min_lr=0.03"], ["optim", "min_lr 0.03 exceeds lr 0.003: the cosine would climb"]),
    (["deepspeed.extra={gradient_accumulation_steps: 1}"],
     ["deepspeed", "extra.gradient_accumulation_steps is the recipe's optim.grad_accum: set those instead"]),
    (["deepspeed.extra={gradient_clipping: 1.0, optimizer: {type: Adam}}"],
     ["extra.gradient_clipping is the recipe's optim.grad_clip; extra.optimizer is the recipe's optim"]),
    (["deepspeed.extra={bf16: {enabled: true}}"], ["extra.bf16 is the recipe's model.precision"]),
    (["deepspeed.extra={zero_optimization: {stage: 3, reduce_bucket_size: 5}}"],
     ["extra.zero_optimization.stage is the recipe's deepspeed.zero_stage"]),
    (["data.eval_fraction=0.5", "data.batch_size=8"],
     ["data", "synthetic data reads none of ['eval_fraction', 'batch_size']"]),
])
def test_bad_overrides_name_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_recipe("ci-tiny", overrides)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_data_path_takes_a_list_of_sources():
    recipe = load_recipe("ci-tiny", ["data.synthetic=null", "data.path=[sharegpt, {path: regen.jsonl, repeat: 3}]"])
    assert recipe.data.sources() == [Source("sharegpt", 1, "data.path[0]"), Source("regen.jsonl", 3, "data.path[1]")]
    assert load_recipe("ci-tiny", ["data.synthetic=null", "data.path=sharegpt"]).data.sources() == [Source("sharegpt")]


@pytest.mark.parametrize("path, words", [
    ("[a.jsonl, {path: b.jsonl, repeat: 0}]", ["data.path[1]", "repeat must be an integer >= 1, got 0"]),
    ("[{path: b.jsonl, repeat: -2}]", ["data.path[0]", "got -2"]),
    ("[a.jsonl, {path: b.jsonl, repeat: 1.5}]", ["data.path[1]", "got 1.5"]),
    ("[a.jsonl, {path: b.jsonl, repeat: '2'}]", ["data.path[1]", "got '2'"]),
    ("[a.jsonl, {path: b.jsonl, repeat: true}]", ["data.path[1]", "got True"]),
    ("[a.jsonl, 3]", ["data.path[1]", "expected a file or packaged data set name", "int 3"]),
    ("[[a.jsonl]]", ["data.path[0]", "list ['a.jsonl']"]),
    ("[{repeat: 2}]", ["data.path[0]", "needs 'path'"]),
    ("[{path: a.jsonl, weight: 2}]", ["data.path[0]", "'weight'"]),
    ("[]", ["data.path", "empty list"]),
])
def test_bad_data_path_entries_name_their_index(path, words):
    with pytest.raises(ConfigError) as err:
        load_recipe("ci-tiny", ["data.synthetic=null", f"data.path={path}"])
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_extra_deepspeed_settings_the_recipe_does_not_own_pass():
    extra = load_recipe("ci-tiny", ["deepspeed.extra={zero_optimization: {reduce_bucket_size: 5}}"]).deepspeed.extra
    assert extra == {"zero_optimization": {"reduce_bucket_size": 5}}


@pytest.mark.parametrize("text, words", [
    ("model:\n  random_target: {hidden_sise: 64}\n", r"bad\.yaml.*model\.random_target\.hidden_sise"),
    ("model: {random_target: {}}\noptim: {betas: [0.9, fast]}\n", r"bad\.yaml: optim: field 'betas'"),
    ("model: {target: /x, random_target: {}}\n", "exactly one of 'target', 'random_target' and 'random_arch'"),
    # YAML keeps the last of two equal keys: a second `optim:` section would silently drop the first's lr.
    ("model: {random_target: {}}\noptim: {lr: 3.0e-3, warmup_steps: 2}\noptim: {total_steps: 8}\n",
     r"(?s)bad\.yaml: not valid YAML: .*key 'optim' given twice.*line 3"),
    ("model: {random_target: {}}\noptim: {lr: 3.0e-3, lr: 1.0e-3}\n", "key 'lr' given twice"),
    ("model: {random_target: {}}\noptim: {[lr]: 3.0e-3}\n", r"a key that is not a name: \['lr'\]"),
    ("- model\n- optim\n", r"bad\.yaml: a recipe is a mapping of sections \(model:, data:, optim:, ...\), not a list"),
    ("\udcff\udcfe", r"bad\.yaml: not valid YAML: 'utf-8' codec can't decode"),  # a binary file
])
def test_bad_file_names_file_and_key(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError, match=words):
        load_recipe(path)


def test_yaml_merge_keys_still_merge(tmp_path):
    """The check for keys given twice leaves YAML's `<<` merges to the loader."""
    path = tmp_path / "merged.yaml"
    path.write_text("model: {random_target: {}}\noptim: {<<: {lr: 3.0e-3, total_steps: 8}, total_steps: 9}\n")
    optim = load_recipe(path).optim
    assert (optim.lr, optim.total_steps) == (3.0e-3, 9)


def test_unknown_recipe_name():
    with pytest.raises(ConfigError, match="ci-tiny"):
        recipe_path("no-such-recipe")


def test_a_directory_named_like_a_recipe_is_not_one(tmp_path, monkeypatch):
    """An earlier `--output ci-tiny` in the working directory leaves the packaged recipe reachable by name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ci-tiny").mkdir()
    assert recipe_path("ci-tiny") == RECIPES_DIR / "ci-tiny.yaml"


@pytest.mark.parametrize("recipe, overrides, words", [
    ("ci-tiny", ["optim.warmup_steps=100", "optim.total_steps=2"],
     ["optim", "got total_steps 2, grad_accum 2, warmup_steps 100"]),
    ("ci-tiny", ["optim.warmupsteps=1"], ["unknown key 'optim.warmupsteps'"]),
    ("no-such-recipe", [], ["recipe 'no-such-recipe': no such file", "ci-tiny"]),
    ("ci-tiny", ["data.synthetic=null", "data.path=missing.jsonl", "data.tokenizer=smollm2-135m-instruct"],
     ["data.path: ", "'missing.jsonl' is neither an existing path"]),
    ("ci-tiny", ["model.aux_layers=[2, 3, 9]"], ["model.aux_layers: aux layers (2, 3, 9) do not exist in a target "
                                                 "of 4 layers"]),
    ("ci-tiny", ["model.aux_layers=[1, 2]"], ["model", "aux_layers must name 3 target layers"]),
    ("ci-tiny", ["model.aux_layers=[3, 2, 4]"], ["model", "in ascending order, the order every engine fuses"]),
    ("ci-tiny", ["model.aux_layers=[1, 2, 3]"], ["model", "aux_layers may not start at layer 1"]),
    ("ci-tiny", ["model.draft_vocab_size=0"], ["model", "draft_vocab_size must be >= 1"]),
    ("ci-tiny", ["data.synthetic.batch_size=0"], ["data.synthetic", "need num_batches, batch_size, seq_len >= 1"]),
    ("ci-tiny", ["optim.betas=[0.9]"], ["optim", "betas must be two numbers in [0, 1)"]),
    ("ci-tiny", ["optim.lr=-1"], ["optim", "lr must be finite and >= 0, got -1.0"]),
    ("ci-tiny", ["optim.lr=.nan"], ["optim", "lr must be finite and >= 0, got nan"]),
    ("ci-tiny", ["optim.lr=fast"], ["optim: field 'lr' should be float, got str 'fast'"]),
    ("ci-tiny", ["optim.grad_clip=.inf"], ["optim", "grad_clip must be finite and >= 0, got inf"]),
    ("quickstart", ["data.max_conversations=0"], ["data", "need max_conversations >= 1 (or unset), got 0"]),
    ("ci-tiny", ["data.synthetic.seq_len=4097"], ["data.synthetic.seq_len 4097 exceeds the target's context of "
                                                  "4096 tokens"]),
    # Paths and the context are checked before the target loads (its config alone is read).
    ("llama3.1-8b-instruct-eagle3", [], ["model.target: target '/path/to/Llama-3.1-8B-Instruct' is neither an "
                                         "existing path", "set it with --set model.target=PATH"]),
    ("quickstart", ["model.init_from=runs/typo/final"], ["model.init_from runs/typo/final: no such directory"]),
    ("quickstart", ["data.tokenizer=no-such-model"], ["data.tokenizer: target 'no-such-model' is neither"]),
    ("quickstart", ["data.max_length=100000"], ["data.max_length 100000 exceeds the target's context of 8192"]),
])
def test_cli_reports_a_bad_recipe_as_a_usage_error(recipe, overrides, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--recipe", recipe, "--output", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        main(argv + [arg for item in overrides for arg in ("--set", item)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "train-eagle: error: " in err and "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


def test_ctrl_c_while_loading_ends_without_a_traceback(tmp_path, monkeypatch, capsys):
    """Before training starts no signal handler is set: Ctrl-C raised KeyboardInterrupt through train-eagle, a
    traceback where the README promises the run just stops (status 130, as for SIGINT)."""
    from eyas.train import trainer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train", interrupted)
    with pytest.raises(SystemExit) as stopped:
        main(["--recipe", "ci-tiny", "--output", str(tmp_path / "run")])
    assert stopped.value.code == 130 and "interrupted before training started" in capsys.readouterr().err
