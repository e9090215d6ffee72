"""Real data through the trainer: SmolLM2's tokenizer and chat template, a 20-conversation JSONL, a tiny random
target with SmolLM2's vocabulary. The split is disjoint and seeded, batches group similar lengths, the draft
vocabulary comes from the training rows' assistant tokens, and the held-out evaluation is logged and exported, also
when training from dumped hidden states and by two ZeRO-3 processes. Mixed sources: a regenerated file
repeated alongside, split before repeating, and bad sources named by their index in data.path."""

import copy
import hashlib
import itertools
import json
import random
import subprocess
import sys
from collections import Counter

import pytest
import torch
import yaml
from datasets import Dataset, Features, List, Value, concatenate_datasets

from eyas.common.config import ConfigError
from eyas.common.head_checkpoint import load_draft_head
from eyas.data.vocab import draft_vocab, token_counts
from eyas.train import checkpoint
from eyas.train.batches import Batches, micro_batches, synthetic_rows
from eyas.train.config import load_recipe, recipe_from_dict
from eyas.train.data import length_groups, lengths_and_digest, load_data, load_rows, repeated_token_counts
from eyas.train.target import build_random_target
from eyas.train.trainer import dump, train
from tests.train import launcher_free_env, metrics

TOKENIZER = "smollm2-135m-instruct"
WORDS = "the draft head predicts tokens of the target model while it verifies many at once".split()


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    rows = []
    for i in range(20):
        question = f"Question {i}: what does word {WORDS[i % len(WORDS)]} mean?"
        answer = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(4 + 3 * (i % 5)))
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def recipe_values(conversations, tmp_path) -> dict:
    return {
        "model": {"random_target": {"vocab_size": 49152, "hidden_size": 32, "intermediate_size": 64,
                                    "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1},
                  "draft_vocab_size": 64},
        "data": {"path": str(conversations), "tokenizer": TOKENIZER, "max_length": 64, "eval_fraction": 0.2,
                 "batch_size": 2, "bucket": 2, "cache_dir": str(tmp_path / "datasets")},
        "optim": {"lr": 3e-3, "total_steps": 4},
        "ttt": {"steps": 2},
        "logging": {"progress": False, "eval_every": 2},
    }


def test_split_batches_and_draft_vocab(conversations, tmp_path):
    recipe = recipe_from_dict(recipe_values(conversations, tmp_path))
    rows = load_rows(recipe, 49152)
    data = load_data(recipe.data, rows, 49152, 64, seed=0)
    train_rows = [i for g in data.train.groups for i in g]
    eval_rows = [i for g in data.eval.groups for i in g]
    assert (len(train_rows), len(eval_rows)) == (16, 4)
    assert sorted(train_rows + eval_rows) == list(range(20))  # disjoint, and every row is used
    batch = data.train[0]
    assert batch["input_ids"].shape[0] == 2 and batch["attention_mask"][:, -1].any()
    # Draft ids are assistant tokens of the training rows (only 20 short answers: fewer than 64 distinct).
    train_part = rows.select(train_rows)
    seen = {t for ids, mask in zip(train_part["input_ids"], train_part["loss_mask"], strict=True)
            for t, k in zip(ids, mask, strict=True) if k}
    assert seen <= set(data.hot.hot_ids.tolist())
    # Counted on the training rows alone: the held-out rows' own tokens would change it.
    assert torch.equal(data.hot.hot_ids, draft_vocab(token_counts(train_part, 49152), 64).hot_ids)
    assert not torch.equal(data.hot.hot_ids, draft_vocab(token_counts(rows, 49152), 64).hot_ids)
    again = load_data(recipe.data, load_rows(recipe, 49152), 49152, 64, seed=0)
    assert again.train.groups == data.train.groups and again.eval.groups == data.eval.groups


def test_a_small_eval_fraction_holds_out_a_row(conversations, tmp_path):
    """1% of 20 rows rounds to none: the evaluations asked for would silently never run."""
    values = recipe_values(conversations, tmp_path)
    values["data"]["eval_fraction"] = 0.01
    recipe = recipe_from_dict(values)
    data = load_data(recipe.data, load_rows(recipe, 49152), 49152, 64, seed=0)
    assert data.eval is not None and [len(g) for g in data.eval.groups] == [1]



def test_data_that_gives_no_row_says_so(conversations, tmp_path):
    """Every conversation's reply past max_length (SmolLM2's template opens with a long system prompt): no rows."""
    values = recipe_values(conversations, tmp_path)
    values["data"]["max_length"] = 8
    recipe = recipe_from_dict(values)
    with pytest.raises(ConfigError, match=r"data.path: no conversation of .*chats.jsonl gave a row with loss tokens"):
        load_rows(recipe, 49152)

@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    """A small file in `python -m eyas.serve.regenerate`'s layout."""
    path = tmp_path_factory.mktemp("regen") / "regen.jsonl"
    lines = [{"index": i, "messages": [{"role": "user", "content": f"Regenerated question {i}?"},
                                       {"role": "assistant", "content": " ".join(WORDS[i : i + 3 + i])}]}
             for i in range(4)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def mixed_recipe(conversations, regenerated, tmp_path, repeat: int, eval_fraction: float):
    values = recipe_values(conversations, tmp_path)
    values["data"] |= {"path": [str(conversations), {"path": str(regenerated), "repeat": repeat}],
                       "eval_fraction": eval_fraction}
    return recipe_from_dict(values)


def test_mixed_sources_repeat(conversations, regenerated, tmp_path):
    """20 + 4 conversations, the 4 twice: 24 rows, each once, and 28 training rows, 8 of them regenerated."""
    recipe = mixed_recipe(conversations, regenerated, tmp_path, repeat=2, eval_fraction=0.0)
    rows = load_rows(recipe, 49152)
    assert list(rows["source"]) == [0] * 20 + [1] * 4
    data = load_data(recipe.data, rows, 49152, 64, seed=0)
    used = [i for g in data.train.groups for i in g]
    assert Counter(rows["source"][i] for i in used) == {0: 20, 1: 8}
    assert Counter(used) == {i: 1 if i < 20 else 2 for i in range(24)}
    assert data.eval is None and set(data.train[0]) == {"input_ids", "loss_mask", "attention_mask"}


def test_mixed_split_keeps_copies_together(conversations, regenerated, tmp_path):
    """Held-out rows are chosen among distinct conversations, before repeating: no conversation (by its tokens) is
    both trained on and held out, every row is used, and only training rows repeat."""
    recipe = mixed_recipe(conversations, regenerated, tmp_path, repeat=3, eval_fraction=0.25)
    rows = load_rows(recipe, 49152)
    data = load_data(recipe.data, rows, 49152, 64, seed=0)
    train_rows = Counter(i for g in data.train.groups for i in g)
    eval_rows = Counter(i for g in data.eval.groups for i in g)
    assert sorted(train_rows | eval_rows) == list(range(24)) and sum(eval_rows.values()) == 6
    assert all(eval_rows[i] == 1 for i in eval_rows)
    assert all(train_rows[i] == (3 if rows["source"][i] else 1) for i in train_rows)
    tokens = [tuple(ids) for ids in rows["input_ids"]]
    assert not {tokens[i] for i in train_rows} & {tokens[i] for i in eval_rows}


def test_draft_vocab_counts_repeats(conversations, regenerated, tmp_path):
    """The draft vocabulary's counts read each distinct training row once, scaled by its repeat: they are the counts
    over the training rows as batched, copies included."""
    recipe = mixed_recipe(conversations, regenerated, tmp_path, repeat=2, eval_fraction=0.25)
    rows = load_rows(recipe, 49152)
    data = load_data(recipe.data, rows, 49152, 4, seed=0)
    trained = [i for g in data.train.groups for i in g]  # the regenerated rows twice
    naive = token_counts(rows.select(trained), 49152)
    distinct = sorted(set(trained))
    counts = repeated_token_counts(rows, distinct, [1 + source for source in rows["source"]], 49152)
    once = token_counts(rows.select(distinct), 49152)
    assert torch.equal(counts, naive) and not torch.equal(counts, once)
    assert torch.equal(data.hot.hot_ids, draft_vocab(naive, 4).hot_ids)
    assert not torch.equal(data.hot.hot_ids, draft_vocab(once, 4).hot_ids)  # the repeats change the top 4


def test_changing_the_mix_changes_the_batches_not_the_token_cache(conversations, regenerated, tmp_path):
    """Each source is tokenized and cached on its own; a repeat acts on the training split only. So another repeat
    reuses the tokenized rows as they are but batches them anew, and another list of sources gives other rows."""
    two, three = (mixed_recipe(conversations, regenerated, tmp_path, repeat=r, eval_fraction=0.25) for r in (2, 3))
    rows = load_rows(two, 49152)
    assert load_rows(three, 49152)._fingerprint == rows._fingerprint
    data = {r: load_data(recipe.data, rows, 49152, 64, seed=0) for r, recipe in ((2, two), (3, three))}
    held_out = {r: sorted(i for g in d.eval.groups for i in g) for r, d in data.items()}
    assert held_out[2] == held_out[3]  # the split ignores repeats
    regen_trained = len(set(range(20, 24)) - set(held_out[2]))
    for r, d in data.items():
        assert sum(map(len, d.train.groups)) == 24 - 6 + (r - 1) * regen_trained
    assert data[2].train.groups != data[3].train.groups
    alone = load_rows(recipe_from_dict(recipe_values(conversations, tmp_path)), 49152)
    assert alone._fingerprint != rows._fingerprint and len(alone) == 20


def test_a_tokenizer_larger_than_the_target_vocabulary_is_refused(conversations, tmp_path):
    values = recipe_values(conversations, tmp_path)
    values["model"]["random_target"]["vocab_size"] = 256
    with pytest.raises(ConfigError, match="tokenizer of smollm2-135m-instruct has 49152 tokens, more than the "
                                          "target's vocabulary of 256: set data.tokenizer"):
        load_rows(recipe_from_dict(values), 256)


def test_a_tokenizer_without_a_chat_template_is_refused_by_key(conversations, smollm2_tokenizer, tmp_path):
    """A base model's tokenizer cannot say which tokens are the assistant's: refused up front, naming the key, not
    failing inside the tokenizing."""
    base = copy.deepcopy(smollm2_tokenizer)
    base.chat_template = None
    base.save_pretrained(tmp_path / "base")
    values = recipe_values(conversations, tmp_path)
    values["data"]["tokenizer"] = str(tmp_path / "base")
    with pytest.raises(ConfigError, match=f"data.tokenizer {tmp_path / 'base'}: its tokenizer has no chat template"):
        load_rows(recipe_from_dict(values), 49152)


def test_a_source_without_a_usable_conversation_is_named_by_key(conversations, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"messages": [{"role": "user", "content": ""}]}) + "\n")
    values = recipe_values(conversations, tmp_path)
    values["data"]["path"] = [str(conversations), str(empty)]
    with pytest.raises(ConfigError, match=r"data.path\[1\]: no usable conversation"):
        load_rows(recipe_from_dict(values), 49152)


@pytest.mark.parametrize("entry, words", [
    ("missing.jsonl", ["data.path[1]: ", "'missing.jsonl' is neither an existing path nor a packaged data set"]),
    ("no-such-set", ["data.path[1]: ", "'no-such-set'", "sharegpt"]),
    (None, ["data.path[1]: ", "is also data.path[0]", "repeat"]),  # the first source again
    (".", ["data.path[1]: ", "is a directory; give a conversations file"]),  # `datasets` failed inside its builder
])
def test_bad_sources_are_named_by_index(conversations, tmp_path, monkeypatch, entry, words):
    monkeypatch.chdir(tmp_path)
    values = recipe_values(conversations, tmp_path)
    values["data"]["path"] = [str(conversations), {"path": entry or str(conversations), "repeat": 2}]
    with pytest.raises(ConfigError) as err:
        load_rows(recipe_from_dict(values), 49152)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_length_groups_sort_within_windows():
    """One window of batch_size x bucket rows holds them all here: its groups are the rows in length order, cut in
    pairs (not pairs of random rows, each sorted)."""
    lengths = [5, 1, 9, 3, 7, 2, 8, 4]
    groups = length_groups(lengths, batch_size=2, bucket=4, rng=random.Random(0))
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert all(lengths[a] <= lengths[b] for a, b in groups)
    assert sorted(sorted(lengths[i] for i in g) for g in groups) == [[1, 2], [3, 4], [5, 7], [8, 9]]


def test_micro_batch_size_is_the_largest_group():
    """What DeepSpeed is told a micro-batch holds: the full groups' size, though shuffling put the short one first."""
    groups = length_groups([5, 1, 9, 3, 7], batch_size=2, bucket=4, rng=random.Random(5))
    assert [len(g) for g in groups] == [1, 2, 2]
    assert Batches([], groups).micro_batch_size == 2


def test_micro_batches_resume_in_place():
    batches = list(range(5))  # stands for batches: positions map to them directly
    first = itertools.islice(micro_batches(batches, 0, rank=1, world_size=2), 7)
    assert list(first) == list(enumerate([1, 3, 0, 2, 4, 1, 3]))
    assert next(micro_batches(batches, 5, rank=1, world_size=2)) == (5, 1)


def test_ranks_take_every_batch_once_an_epoch():
    """10 batches over 4 ranks: position by position, the ranks take the batches in order, epoch after epoch, so each
    rank takes one at every position and no batch is trained on more often than another (ranks each cycling through
    their own 3 or 2 batches would train batches 2, 3, 6, 7 three times in 6 positions, the others twice)."""
    dealt = [[b for _, b in itertools.islice(micro_batches(range(10), 0, rank, 4), 6)] for rank in range(4)]
    assert [dealt[rank][p] for p in range(6) for rank in range(4)] == [*range(10), *range(10), 0, 1, 2, 3]


@pytest.fixture(scope="module")
def real_values(conversations, tmp_path_factory) -> dict:
    # A random target's argmax is rarely among a few frequent tokens: draft over the whole vocab to count some.
    values = recipe_values(conversations, tmp_path_factory.mktemp("real"))
    values["model"]["draft_vocab_size"] = 49152
    return values


@pytest.fixture(scope="module")
def real_run(real_values, tmp_path_factory):
    run = tmp_path_factory.mktemp("real-run")
    assert train(recipe_from_dict(real_values), run) == run / "final"
    return run


def test_trainer_on_real_data(real_values, real_run):
    records = metrics(real_run)
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(r["tokens"] > 0 and len(r["acc"]) == 2 and 1 <= r["tau"] <= 3 for r in evals)
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    assert json.loads((real_run / "final" / "eval.json").read_text()) == evals[-1]
    head = load_draft_head(real_run / "final", build_random_target(recipe_from_dict(real_values).model.random_target))
    assert head.config.vocab_size == head.config.draft_vocab_size == 49152


def test_a_finished_run_run_again_logs_its_evaluations_once(real_values, tmp_path):
    """Run again, a finished run resumes at its last step's checkpoint and only evaluates and exports again: its
    metrics read as before, the final evaluation once."""
    values = copy.deepcopy(real_values)
    values["checkpoint"] = {"every": 4}
    recipe = recipe_from_dict(values)
    assert train(recipe, tmp_path) == tmp_path / "final"
    first = metrics(tmp_path)
    assert train(recipe, tmp_path) == tmp_path / "final"
    assert metrics(tmp_path) == first
    assert [r["step"] for r in first if r["split"] == "eval"] == [0, 2, 4]


@pytest.mark.parametrize("old, new", [
    ("?", "? Answer in a long sentence, please."),
    ("Question 3:", "Question 7:"),  # the same number of tokens: only the tokens tell
])
def test_a_checkpoint_of_rows_edited_since_is_refused(conversations, tmp_path, old, new):
    """The recipe unchanged, but a conversation of its file rewritten after the checkpoint: the checkpoint's data
    position (and held-out split) would mean other rows, so resuming is refused, also when every row keeps its
    length (another chat template or tokenizer of the same lengths, a word for another)."""
    data = tmp_path / "chats.jsonl"
    data.write_text(conversations.read_text())
    values = recipe_values(conversations, tmp_path)
    values["data"]["path"] = str(data)
    values["checkpoint"] = {"every": 1, "stop_after": 1}
    recipe = recipe_from_dict(values)
    assert train(recipe, tmp_path / "run") is None
    before = load_rows(recipe, 49152)["input_ids"]
    lines = data.read_text().splitlines(keepends=True)
    lines[3] = lines[3].replace(old, new)
    data.write_text("".join(lines))
    after = load_rows(recipe, 49152)["input_ids"]
    assert after != before and (list(map(len, after)) == list(map(len, before))) == (len(old) == len(new))
    with pytest.raises(ConfigError, match="step_1 was trained on other rows than the recipe's data gives now"):
        train(recipe, tmp_path / "run")


def test_a_checkpoint_of_an_earlier_eyas_is_checked_on_the_row_lengths_it_recorded(tmp_path):
    """Earlier eyas recorded under "rows" a hash of the rows' lengths alone, a string: such a checkpoint resumes
    when the lengths are the same (the tokens it cannot tell) and is refused when they are not."""
    recipe = load_recipe("ci-tiny")
    rows = synthetic_rows(recipe.data.synthetic, 256)  # 8 rows of 32 tokens
    rows_record = load_data(recipe.data, rows, 256, 64, seed=0).rows_record

    def resume(lengths: list[int]) -> None:
        record = hashlib.sha256(str(lengths).encode()).hexdigest()[:16]  # as earlier eyas wrote it
        (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 1, "rows": record}))
        checkpoint.check_same_rows(tmp_path, rows_record)

    resume([32] * 8)
    with pytest.raises(ConfigError, match="trained on other rows than the recipe's data gives now"):
        resume([32] * 7 + [31])


def test_the_rows_digest_is_of_their_tokens_not_of_their_storage():
    """Any token or mask value changes the digest, the lengths kept; how the rows are stored (int type, Arrow chunks,
    an index mapping after `select`) does not."""
    ids, mask = [[5, 6, 7], [8, 9]], [[0, 1, 1], [1, 1]]
    lengths, digest = lengths_and_digest(Dataset.from_dict({"input_ids": ids, "loss_mask": mask}))
    assert lengths == [3, 2]
    edits = [([[5, 6, 7], [8, 10]], mask), (ids, [[1, 1, 1], [1, 1]]), ([[5, 6], [7, 8, 9]], [[0, 1], [1, 1, 1]])]
    for other_ids, other_mask in edits:
        assert lengths_and_digest(Dataset.from_dict({"input_ids": other_ids, "loss_mask": other_mask}))[1] != digest
    features = Features({"input_ids": List(Value("int32")), "loss_mask": List(Value("int8"))})
    stored = concatenate_datasets([Dataset.from_dict({"input_ids": [[0]], "loss_mask": [[0]]}, features),
                                   Dataset.from_dict({"input_ids": ids, "loss_mask": mask}, features)]).select([1, 2])
    assert lengths_and_digest(stored) == (lengths, digest)


def test_offline_on_real_data(real_values, real_run, tmp_path):
    """Trained from dumped hidden states, the same split and batches: the online run's train and eval records."""
    values = copy.deepcopy(real_values)
    values["data"]["hidden_states"] = str(tmp_path / "states")
    recipe = recipe_from_dict(values)
    dump(recipe)
    train(recipe, tmp_path / "run")
    online, offline = metrics(real_run), metrics(tmp_path / "run")
    assert [(r["split"], r["step"], r["tokens"]) for r in offline] == [(r["split"], r["step"], r["tokens"])
                                                                        for r in online]
    for want, got in zip(online, offline, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and got["acc"] == pytest.approx(want["acc"])


def test_zero3_on_two_processes(real_values, tmp_path):
    """Two CPU processes, ZeRO-3 with every parameter partitioned, 3 held-out micro-batches: each rank runs as many
    forwards (ZeRO-3 gathers in each, so the last round's lone batch would leave the other rank waiting forever), and
    the evaluation of the untrained head is the one-process one; the head exported from the partitions loads."""
    values = copy.deepcopy(real_values)
    values["data"]["eval_fraction"] = 0.25  # 5 rows: micro-batches of 2, 2 and 1
    values["optim"]["total_steps"] = 2
    values["deepspeed"] = {"zero_stage": 3, "extra": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "eyas.train.cli", "--recipe", str(path), "--output", str(tmp_path / "two")]
    log, limit = tmp_path / "two.log", 240  # seconds; ~25 on 2 busy cores
    with open(log, "w") as out:
        launcher = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                    env=launcher_free_env() | {"OMP_NUM_THREADS": "1"})
        try:
            assert launcher.wait(timeout=limit) == 0, log.read_text()
        except subprocess.TimeoutExpired:
            launcher.terminate()  # on SIGTERM the launcher kills its workers (each in a session of its own)
            launcher.wait()
            raise AssertionError(f"the two processes did not finish in {limit} s:\n" + log.read_text()) from None

    recipe = recipe_from_dict(values)
    train(recipe, tmp_path / "one")
    one, two = (json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0]) for run in ("one", "two"))
    assert one["split"] == two["split"] == "eval" and one["step"] == two["step"] == 0
    assert two["tokens"] == one["tokens"] > 0
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6) and two["acc"] == pytest.approx(one["acc"])
    head = load_draft_head(tmp_path / "two" / "final", build_random_target(recipe.model.random_target))
    assert head.config.draft_vocab_size == 49152
