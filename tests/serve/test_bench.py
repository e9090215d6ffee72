"""bench-eagle runs end to end on a tiny random architecture and writes what serve-eagle reads."""

import gc
import json
import statistics
import weakref

import pytest
import torch

from eyas.common.architectures import random_target
from eyas.serve import bench
from eyas.serve.autotune import format_setting, read_autotune, setting_for
from eyas.serve.bench import OFF_WITH_HEAD, Result, generate_all, main, random_head, warm_engine
from eyas.serve.draft import TreeShape
from eyas.serve.engine import Engine
from eyas.serve.sampling import SamplingParams, for_prompt


def test_bench_tiny_random(tmp_path, capsys):
    main(["--random-weights", "--arch", "tiny", "--input-len", "32", "--output-len", "12",
          "--batch-sizes", "1", "2", "--num-prompts", "3", "--trees", "3,1,4", "2,2,4", "--device", "cpu",
          "--autotune", str(tmp_path / "autotune.json"), "--json", str(tmp_path / "results.json")])
    table = capsys.readouterr().out
    assert "speedup" in table and table.count("\n") == 9  # header + 2 batch sizes x 4 settings
    results = json.loads((tmp_path / "results.json").read_text())
    assert {(r["batch_size"], r["setting"]) for r in results} == {
        (b, s) for b in (1, 2) for s in ("off", "3,1,4", "2,2,4", OFF_WITH_HEAD)}
    off = {r["batch_size"]: r for r in results if r["setting"] == "off"}
    for r in results:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["host_ms"] > 0 and r["prefill_ms"] > 0
        off_ms = off[r["batch_size"]]["served_ms"]
        assert r["served_ms"] > 0 and r["step_vs_off"] == pytest.approx(r["served_ms"] / off_ms)
        if r["setting"] == "off":
            assert r["speedup"] == 1.0 and r["draft_ms"] < r["verify_ms"]
    best = json.loads((tmp_path / "autotune.json").read_text())["best_setting_by_batch_size"]
    assert set(best) == {"1", "2"} and all(v in ("off", "3,1,4", "2,2,4") for v in best.values())
    # serve-eagle's reader: the same settings, in batch-size order, each batch size mapped to its bucket.
    table = read_autotune(tmp_path / "autotune.json")
    assert [b for b, _ in table] == [1, 2] and setting_for(table, 5) == table[-1][1]


@pytest.mark.parametrize("off_with_head, best", [(60.0, "3,1,4"), (90.0, "off")])
def test_autotune_picks_what_a_server_can_run(monkeypatch, tmp_path, capsys, off_with_head, best):
    """An autotuned server runs a batch size whose setting is off with the head loaded: the
    autotune weighs that run, never the head-less "off", however fast."""
    speeds = {"off": 100.0, "3,1,4": 80.0, "2,2,4": 50.0, OFF_WITH_HEAD: off_with_head}

    def measured(target, head, settings, prompts, new_tokens, batch_size, params, **options):
        labels = [OFF_WITH_HEAD if head_kept else format_setting(shape) for shape, head_kept in settings]
        return [Result(batch_size, label, 1.0, 1.0, 0.1, 0.8, 0.1, 0.1, 1.0, speeds[label], 0.0, 1.0)
                for label in labels]

    monkeypatch.setattr(bench, "run_settings", measured)
    main(["--random-weights", "--arch", "tiny", "--input-len", "8", "--output-len", "3", "--trees", "3,1,4", "2,2,4",
          "--device", "cpu", "--autotune", str(tmp_path / "autotune.json")])
    assert json.loads((tmp_path / "autotune.json").read_text())["best_setting_by_batch_size"] == {"1": best}


def test_json_keeps_the_batch_sizes_measured_before_a_failure(monkeypatch, tmp_path):
    def measured(target, head, settings, prompts, new_tokens, batch_size, params, **options):
        if batch_size == 4:
            raise RuntimeError("CUDA out of memory")
        return [Result(batch_size, format_setting(shape), 1.0, 1.0, 0.1, 0.8, 0.1, 0.1, 1.0, 100.0, 0.0, 1.0)
                for shape, _ in settings]

    monkeypatch.setattr(bench, "run_settings", measured)
    with pytest.raises(RuntimeError, match="out of memory"):
        main(["--random-weights", "--arch", "tiny", "--input-len", "8", "--output-len", "3", "--trees", "3,1,4",
              "--batch-sizes", "1", "2", "4", "--device", "cpu", "--json", str(tmp_path / "r.json")])
    results = json.loads((tmp_path / "r.json").read_text())
    assert [(r["batch_size"], r["setting"]) for r in results] == [(1, "off"), (1, "3,1,4"), (2, "off"), (2, "3,1,4")]


def test_off_with_the_head_kept_extends_the_head_and_drafts_nothing():
    target = random_target("tiny", torch.float32, "cpu")
    prompts = [list(range(3, 20)), list(range(5, 30))]
    engine = warm_engine(target, random_head(target), None, prompts, 6, 2, head_kept=True)
    extended = []
    extend = engine.drafter.extend
    engine.drafter.extend = lambda *args, **kw: extended.append(1) or extend(*args, **kw)
    requests = generate_all(engine, prompts, 6, 2)
    assert setting_for(engine.tree_by_batch, 2) is None and extended
    assert all(len(r.output) == 6 and r.accepted == [] for r in requests)


def test_every_batch_is_whole(monkeypatch, capsys):
    """--num-prompts is rounded up to whole batches: a last, smaller batch would be timed as this batch size."""
    rows = []
    sampling = Engine._sampling
    monkeypatch.setattr(Engine, "_sampling", lambda self, requests, *args: rows.append(len(requests)) or sampling(
        self, requests, *args))
    main(["--random-weights", "--arch", "tiny", "--input-len", "8", "--output-len", "4", "--batch-sizes", "2",
          "--num-prompts", "3", "--trees", "2,1,3", "--device", "cpu"])
    assert rows and set(rows) == {2}


@pytest.mark.parametrize("tree, message", [
    ("7,1", "argument --trees: expected 'off' or 'num_steps,topk,num_draft_tokens', got '7,1'"),
    ("3,1,9", "argument --trees: num_draft_tokens 9 exceeds"),
    ("off", "--trees: off is always measured"),
])
def test_bad_tree_is_a_usage_error(tree, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--random-weights", "--arch", "tiny", "--trees", tree, "--device", "cpu"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_at_a_temperature_samples(monkeypatch, capsys):
    decode_steps = []  # each decode step's requests' sampling parameters
    sampling = Engine._sampling
    monkeypatch.setattr(Engine, "_sampling", lambda self, requests, *args: decode_steps.append(
        [r.params for r in requests]) or sampling(self, requests, *args))
    main(["--random-weights", "--arch", "tiny", "--input-len", "16", "--output-len", "6", "--batch-sizes", "2",
          "--trees", "2,2,4", "--temperature", "0.9", "--top-p", "0.8", "--top-k", "50", "--device", "cpu"])
    assert "speedup" in capsys.readouterr().out
    assert decode_steps and all((p.temperature, p.top_p, p.top_k) == (0.9, 0.8, 50)
                                for params in decode_steps for p in params)


def test_a_seeded_bench_draws_each_prompt_with_its_own_seed_in_every_run(monkeypatch):
    """The untimed, timed, served and phase runs all draw a prompt with the seed `for_prompt` gives it."""
    added = []  # (prompt, seed) of every request
    add_request = Engine.add_request
    monkeypatch.setattr(Engine, "add_request", lambda self, prompt, params, *args: added.append(
        (tuple(prompt), params.seed)) or add_request(self, prompt, params, *args))
    main(["--random-weights", "--arch", "tiny", "--input-len", "16", "--output-len", "4", "--batch-sizes", "2",
          "--trees", "2,2,4", "--temperature", "0.9", "--seed", "5", "--repeats", "2", "--device", "cpu"])
    run = SamplingParams(temperature=0.9, seed=5)
    prompts = {prompt for prompt, _ in added}
    assert len(prompts) == 2 and len(added) >= 2 * 2 * 5  # off and the tree: untimed, 2 timed, served, phases
    assert all(seed == for_prompt(run, list(prompt)).seed for prompt, seed in added)


@pytest.mark.parametrize("args, words", [(["--output-len", "1"], "--output-len must be at least 2, got 1"),
                                         (["--seed", "3"], "--seed seeds sampled tokens: set --temperature above 0"),
                                         (["--temperature", "0.7", "--compare-hf"], "--compare-hf times Hugging "
                                          "Face's greedy generate: leave --temperature at 0"),
                                         (["--draft", "head", "--compare-hf"],
                                          "--random-weights measures a random model of --arch: --draft, --compare-hf "
                                          "would be ignored"),
                                         (["--draft-vocab", "0"], "--draft-vocab must be at least 1, got 0"),
                                         (["--num-prompts", "0"], "--num-prompts must be at least 1, got 0"),
                                         (["--batch-sizes", "1", "0"], "--batch-sizes must be at least 1, got 0"),
                                         (["--input-len", "-3"], "--input-len must be at least 1, got -3"),
                                         (["--prompts", "p.jsonl", "--input-len", "64"], "a --prompts file's "
                                          "prompt_ids are the prompts, whole: --input-len would be ignored"),
                                         (["--json", "no/such/dir/r.json"], "--json no/such/dir/r.json: no directory"),
                                         (["--autotune", "no/dir/a.json"], "--autotune no/dir/a.json: no directory"),
                                         (["--autotune", "."], "--autotune .: a directory; give the file's name"),
                                         (["--attention", "flashinfer"], "--attention flashinfer: the flashinfer "
                                          "attention backend needs a CUDA device")])
def test_arguments_it_cannot_use_are_usage_errors(args, words, capsys, monkeypatch):
    monkeypatch.setattr(bench, "random_target", lambda *args: pytest.fail("built a model"))
    with pytest.raises(SystemExit) as exit_info:  # refused before any model is built
        main(["--random-weights", "--arch", "tiny", "--device", "cpu", *args])
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_draft_vocab_sizes_the_random_head(monkeypatch, capsys):
    import eyas.serve.bench as bench

    heads = []
    run_settings = bench.run_settings
    monkeypatch.setattr(bench, "run_settings", lambda target, head, *args, **kw: heads.append(head) or run_settings(
        target, head, *args, **kw))
    main(["--random-weights", "--arch", "tiny", "--input-len", "8", "--output-len", "3", "--trees", "2,2,3",
          "--draft-vocab", "100", "--device", "cpu"])
    assert heads and all(h.lm_head.out_features == h.config.draft_vocab_size == 100 for h in heads)
    assert "speedup" in capsys.readouterr().out


@pytest.mark.parametrize("args, words", [
    (["--draft-vocab", "2", "--trees", "2,4,8"], "--trees 2,4,8: topk 4 is more than the head's draft vocabulary of 2"),
    (["--input-len", "5000"], "prompts of up to 5000 tokens, --output-len 128 and the trees' 48 positions of a step's "
                              "drafts pass the target's context"),
])
def test_settings_the_model_cannot_run_are_usage_errors_before_the_sweep(args, words, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run_settings", lambda *args, **kw: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--random-weights", "--arch", "tiny", "--device", "cpu", *args])
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_arch_without_random_weights_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(bench, "load_models_for", lambda *args: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--target", "t", "--draft", "d", "--arch", "llama-3.1-8b", "--device", "cpu"])
    assert exit_info.value.code == 2 and "--arch names the random model of --random-weights: --arch would be " \
        "ignored" in capsys.readouterr().err


def test_draft_vocab_of_a_trained_head_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--target", "t", "--draft", "d", "--draft-vocab", "8000", "--device", "cpu"])
    assert exit_info.value.code == 2 and "--draft-vocab sizes the random head" in capsys.readouterr().err


def test_kv_room_for_the_largest_tree():
    """warm_engine sizes the KV pool so that every prompt gets all its new tokens, whatever the tree."""
    target = random_target("tiny", torch.float32, "cpu")
    prompts = [list(range(3, 39))]
    engine = warm_engine(target, random_head(target), TreeShape(3, 8, 130), prompts, 12, 1)
    assert [len(r.output) for r in generate_all(engine, prompts, 12, 1)] == [12]


def test_chat_prompt_set_with_random_weights_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:  # refused before the random model is built
        main(["--random-weights", "--arch", "tiny", "--prompts", "mt-bench", "--device", "cpu"])
    assert exit_info.value.code == 2 and "real --target's tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("text, words", [('{"prompt_ids": [1, 2]}\n{"prompt": "Hi"}\n', "p.jsonl, line 2: expected "
                                                                                       "'prompt_ids'"),
                                         ('{"prompt_ids": [1, 2]\n', "p.jsonl, line 1: malformed JSON: Expecting ','"),
                                         ("\n", "p.jsonl: no prompts"),
                                         ('{"prompt_ids": [1, 99999]}\n', "p.jsonl, line 1: expected 'prompt_ids', "
                                          "a non-empty list of token ids in [0, ")])
def test_bad_token_prompt_file_is_a_usage_error(tmp_path, capsys, text, words):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["--random-weights", "--arch", "tiny", "--prompts", str(path), "--device", "cpu"])
    assert exit_info.value.code == 2 and f"--prompts: {path.parent}/{words}" in capsys.readouterr().err


def test_autotune_file_errors_name_the_entry(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"best_setting_by_batch_size": {"4": "off", "1": "7,1,8", "16": "5,4,8"}}))
    table = read_autotune(path)
    assert table == ((1, TreeShape(7, 1, 8)), (4, None), (16, TreeShape(5, 4, 8)))
    assert [setting_for(table, b) for b in (1, 2, 4, 5, 64)] == [
        TreeShape(7, 1, 8), None, None, TreeShape(5, 4, 8), TreeShape(5, 4, 8)]
    path.write_text(json.dumps({"best_setting_by_batch_size": {"8": "7,1"}}))
    with pytest.raises(ValueError, match=r"a.json: entry '8': expected 'off' or"):
        read_autotune(path)
    path.write_text(json.dumps({"settings": {}}))
    with pytest.raises(ValueError, match="not an autotune file"):
        read_autotune(path)
    for table in ({"best_setting_by_batch_size": ["7,1,8"]}, {"best_setting_by_batch_size": None}, ["7,1,8"]):
        path.write_text(json.dumps(table))
        with pytest.raises(ValueError, match=r'a.json: not an autotune file \(\{"best_setting_by_batch_size": \{b'):
            read_autotune(path)
    path.write_text(json.dumps({"best_setting_by_batch_size": {"1": 7}}))  # a setting that is not a string
    with pytest.raises(ValueError, match=r"a.json: entry '1': expected 'off' or 'num_steps,topk,num_dr.*', got 7$"):
        read_autotune(path)
    path.write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="a.json: not JSON"):
        read_autotune(path)
    with pytest.raises(ValueError, match=r"missing.json: cannot be read \(No such file or directory\)"):
        read_autotune(tmp_path / "missing.json")
    path.write_text(json.dumps({"best_setting_by_batch_size": {"1": "off", "01": "7,1,8"}}))
    with pytest.raises(ValueError, match="a.json: entry '01': batch size 1 is given twice"):
        read_autotune(path)


@pytest.mark.parametrize("name", ["sharegpt", "mt-bench", "humaneval"])
def test_chat_prompts_from_packaged_sets(name, smollm2_tokenizer):
    from eyas.serve.bench import chat_prompts

    prompts = chat_prompts(name, smollm2_tokenizer, 6, 128)
    assert len(prompts) == 6 and all(len(p) <= 128 for p in prompts)
    text = smollm2_tokenizer.decode(prompts[0])
    assert text.count("<|im_start|>user") == 1 and text.rstrip().endswith("<|im_start|>assistant")
    with pytest.raises(ValueError, match="fits --input-len 3"):
        chat_prompts(name, smollm2_tokenizer, 1, 3)


@pytest.mark.parametrize("repeats", [1, 3])
def test_repeats_time_each_setting_in_rounds_and_report_the_median_run(monkeypatch, tmp_path, capsys, repeats):
    runs = []  # generate_all's calls: per setting, the untimed run, the timed ones, then none (profiling)
    generate = bench.generate_all
    monkeypatch.setattr(bench, "generate_all", lambda engine, *args, **kw: runs.append(engine) or generate(
        engine, *args, **kw))
    main(["--random-weights", "--arch", "tiny", "--input-len", "8", "--output-len", "4", "--trees", "2,1,3", "2,2,3",
          "--repeats", str(repeats), "--device", "cpu", "--json", str(tmp_path / "r.json")])
    engines = list(dict.fromkeys(runs))
    assert len(engines) == 3  # off, 2,1,3 and 2,2,3
    if repeats == 1:  # one engine at a time: its untimed run, then its timed one
        assert runs == [e for e in engines for _ in range(2)]
    else:  # every engine warmed, then rounds that time each once: a drift over the sweep falls on all alike
        assert runs == engines + engines * repeats
    results = json.loads((tmp_path / "r.json").read_text())
    for r in results:
        speeds = r["tokens_per_s_runs"]
        assert len(speeds) == repeats and r["tokens_per_s"] == statistics.median(speeds)
        assert r["spread"] == pytest.approx((max(speeds) - min(speeds)) / r["tokens_per_s"])
    assert "spread" in capsys.readouterr().out


def test_timed_runs_run_with_the_heap_frozen_and_unfreeze_it(monkeypatch):
    """No full collection stalls a timed run (`frozen_heap`), and the heap is collectable again after the group."""
    frozen, timed_run = [], bench._timed_run
    monkeypatch.setattr(bench, "_timed_run", lambda *args: frozen.append(gc.get_freeze_count()) or timed_run(*args))
    target = random_target("tiny", torch.float32, "cpu")
    bench.run_settings(target, None, [(None, False)], [list(range(10, 30))], 4, 1, repeats=2)
    assert len(frozen) == 2 and min(frozen) > 10_000 and gc.get_freeze_count() == 0


def test_a_groups_engines_are_freed_before_the_next_group_reads_the_memory_in_use(monkeypatch):
    """One setting at a time, each engine is gone when the next is built: the memory read then as the weights' (the
    base of a setting's peak) must not hold the last setting's KV and graphs."""
    built, alive_at_build = [], []
    warmed = bench._warmed

    def track(*args, **kwargs):
        alive_at_build.append([ref() is not None for ref in built])
        engine, added = warmed(*args, **kwargs)
        built.append(weakref.ref(engine))
        return engine, added

    monkeypatch.setattr(bench, "_warmed", track)
    target = random_target("tiny", torch.float32, "cpu")
    settings = [(None, False), (TreeShape(2, 1, 3), False), (TreeShape(2, 2, 3), False)]
    bench.run_settings(target, random_head(target), settings, [list(range(10, 30))] * 2, 4, 2)
    assert alive_at_build == [[], [False], [False, False]]


@pytest.mark.gpu
def test_an_interleaved_settings_peak_memory_is_its_own_and_goes_with_its_engine():
    """With repeats the settings' engines are held at once: each setting's peak still counts the weights and its own
    engine alone, as when they run one at a time. (Each engine's KV, 16 prompts of 1,500 tokens, is about twice the
    weights: a peak that counted the engines built before it would be far off.) Nothing an engine allocated outlives
    it: a new stream each capture warmed up on kept a cuBLAS workspace each, about 0.1 GiB an engine here."""
    target = random_target("smollm2-135m", torch.bfloat16, "cuda")
    head = random_head(target)
    settings = [(None, False), (TreeShape(5, 4, 8), False), (TreeShape(6, 8, 48), False)]
    prompts = [list(range(10, 1510))] * 16

    def peaks(repeats):
        return [r.peak_gib for r in bench.run_settings(target, head, settings, prompts, 8, 16, repeats=repeats)]

    def held():
        gc.collect()  # the last group's engines (their graphs hold cycles)
        return torch.cuda.memory_allocated()

    alone = peaks(1)
    after_alone = held()
    assert peaks(2) == pytest.approx(alone, rel=0.05)
    assert held() - after_alone < 8 * 2**20


def test_the_served_step_times_overlapping_decode_steps_and_no_prefill(monkeypatch):
    """Between its two syncs run only decode steps, unprofiled (so each is queued while the last runs)."""
    target = random_target("tiny", torch.float32, "cpu")
    engine = warm_engine(target, random_head(target), TreeShape(2, 2, 4), [[1, 2, 3]] * 2, 6, 2)
    events = []
    monkeypatch.setattr(bench, "_sync", lambda device: events.append("sync"))
    for name in ("_prefill", "_launch_decode"):
        method = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _m=method, _n=name, **kw: events.append(
            (_n, engine.profile)) or _m(*a, **kw))
    ms = bench._served_step_ms(engine, [[5, 6, 7, 8], [9, 10]], 6, [bench.GREEDY] * 2)
    first, last = events.index("sync"), len(events) - 1
    assert ms > 0 and events[last] == "sync" and events.count("sync") == 2
    assert set(events[:first]) == {("_prefill", False)}
    assert events[first + 1:last] == [("_launch_decode", False)] * engine.decode_steps and engine.decode_steps >= 5
