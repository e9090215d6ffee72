"""Regeneration rewrites assistant turns in order, keeps conversations in flight independently, and resumes."""

import gzip
import json

import pytest
import torch

from eyas.common.target import TargetModel
from eyas.data.tokenizer import render_chat, stop_token_ids
from eyas.serve import regenerate as regenerate_module
from eyas.serve.clients import Answer, Client, EngineClient
from eyas.serve.engine import Engine, EngineConfig
from eyas.serve.generate import greedy_tokens
from eyas.serve.regenerate import regenerate, regenerate_file, written_indices
from eyas.serve.sampling import SamplingParams
from tests.conftest import make_hf_model


class EchoClient(Client):
    """Answers "<messages seen>:<last user text>" (or `reply(prompt)`); `collect` returns the oldest pending
    prompt only, so conversations finish out of step. Records each prompt's length in `calls`."""

    def __init__(self, calls, reply=None):
        self.calls, self.pending = calls, []
        self.reply = reply or (lambda p: f"{len(p)}:{p[-1]['content']}")

    def submit(self, prompt):
        self.calls.append(len(prompt))
        handle = object()
        self.pending.append((handle, Answer(self.reply(prompt), 1, [])))
        return handle

    def collect(self):
        return [self.pending.pop(0)]


def conv(*texts):
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


def test_turns_are_rewritten_in_order_and_conversations_refill():
    calls = []
    convs = [conv("a", "old", "b", "old"), conv("c", "old"), conv("d", "old")]
    out = list(regenerate(enumerate(convs), EchoClient(calls), in_flight=2))
    # a's first reply comes back first: a asks for its second turn at once, c's reply then finishes c,
    # whose place goes to d.
    assert out == [(1, conv("c", "1:c")), (0, conv("a", "1:a", "b", "3:b")), (2, conv("d", "1:d"))]
    assert calls == [1, 1, 3, 1]


def test_empty_reply_ends_the_conversation():
    client = EchoClient([], reply=lambda p: "" if len(p) > 1 else "ok")
    assert list(regenerate([(0, conv("a", "x", "b", "y"))], client, in_flight=4)) == [(0, conv("a", "ok"))]


def test_file_resumes_after_interruption(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"messages": conv(f"q{i}", "old")}) + "\n" for i in range(5)))
    out = tmp_path / "out.jsonl"
    assert regenerate_file(data, out, EchoClient([]), batch_size=2, limit=3) == 3
    with open(out, "a") as f:
        f.write('{"index": 3, "mess')  # a line cut by a kill: the rerun truncates it and writes 3 again
    calls = []
    assert regenerate_file(data, out, EchoClient(calls), batch_size=2) == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4] and calls == [1, 1]  # only the two left ran
    assert rows[4]["messages"] == conv("q4", "1:q4") and rows[4]["place"] == "line 5"
    # A whole record whose newline was cut is rewritten too (appending to it would join two records).
    out.write_text(out.read_text()[:-1])
    assert regenerate_file(data, out, EchoClient([]), batch_size=2) == 1
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1, 2, 3, 4]


def test_a_resume_from_another_data_file_is_refused(tmp_path, capsys):
    """The output's indices count its own --data's conversations (`<output>.source`): resuming it with another file
    would skip that file's first conversations and number the rest wrongly; the same file resumes."""
    data, other, out = tmp_path / "in.jsonl", tmp_path / "other.jsonl", tmp_path / "out.jsonl"
    data.write_text("".join(json.dumps({"messages": conv(f"q{i}", "old")}) + "\n" for i in range(3)))
    other.write_text("".join(json.dumps({"messages": conv(f"r{i}", "old")}) + "\n" for i in range(3)))
    assert regenerate_file(data, out, EchoClient([]), batch_size=2, limit=2) == 2
    with pytest.raises(SystemExit) as stopped:  # the target "unused" would raise FileNotFoundError if loaded
        regenerate_module.main(["--data", str(other), "--output", str(out), "--target", "unused"])
    assert stopped.value.code == 2 and "holds conversations of another data file" in capsys.readouterr().err
    assert regenerate_file(data, out, EchoClient([]), batch_size=2) == 1  # the same file: the one left


def test_an_output_with_nothing_written_takes_any_data_file(tmp_path):
    """A run that wrote nothing (its model failed to load, say) leaves a source recorded but no conversation to
    misnumber: a rerun with another --data starts afresh."""
    data, other, out = tmp_path / "in.jsonl", tmp_path / "other.jsonl", tmp_path / "out.jsonl"
    data.write_text(json.dumps({"messages": conv("q", "old")}) + "\n")
    other.write_text(json.dumps({"messages": conv("a longer question", "old")}) + "\n")
    assert regenerate_file(data, out, EchoClient([], reply=lambda p: ""), batch_size=1) == 0  # dropped: written
    assert regenerate_file(data, tmp_path / "fresh.jsonl", EchoClient([]), batch_size=1, limit=1) == 1
    (tmp_path / "fresh.jsonl").unlink()  # as if its first run had failed before writing
    assert regenerate_file(other, tmp_path / "fresh.jsonl", EchoClient([]), batch_size=1) == 1
    with pytest.raises(ValueError, match="another data file"):  # the dropped conversation counts as written
        regenerate_file(other, out, EchoClient([]), batch_size=1)


def test_conversations_without_an_assistant_turn_are_not_asked_again(tmp_path):
    """A first prompt answered empty (or refused) leaves nothing to train on: listed in `<output>.dropped`, not in
    the output, and a rerun does not ask for it again."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"messages": conv(f"q{i}", "old")}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"

    def silent_on_q1(prompt):
        return "" if prompt[-1]["content"] == "q1" else "ok"

    assert regenerate_file(data, out, EchoClient([], reply=silent_on_q1), batch_size=2) == 2
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 2]
    assert (tmp_path / "out.jsonl.dropped").read_text() == '{"index": 1}\n'
    calls = []
    assert regenerate_file(data, out, EchoClient(calls), batch_size=2) == 0 and calls == []


def test_shards_split_the_conversations(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"messages": conv(f"q{i}", "old")}) + "\n" for i in range(5)))
    indices = []
    for i in range(2):
        out = tmp_path / f"shard{i}.jsonl"
        regenerate_file(data, out, EchoClient([]), batch_size=2, shard=(i, 2))
        indices.append([json.loads(line)["index"] for line in out.read_text().splitlines()])
    assert indices == [[0, 2, 4], [1, 3]]


def test_interrupt_stops_cleanly_and_resumes(tmp_path, monkeypatch, capsys):
    """Ctrl-C (KeyboardInterrupt) mid-run: exit code 130, one line naming what was written; a rerun resumes."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"messages": conv(f"q{i}", "old")}) + "\n" for i in range(5)))
    out = tmp_path / "out.jsonl"

    class Interrupted(EchoClient):
        def collect(self):
            if len(self.calls) > 3:  # after two conversations are written
                raise KeyboardInterrupt
            return super().collect()

    command = ["--data", str(data), "--output", str(out), "--endpoint", "http://unused", "--batch-size", "2"]
    monkeypatch.setattr(regenerate_module, "EndpointClient", lambda *args: Interrupted([]))
    with pytest.raises(SystemExit) as stopped:
        regenerate_module.main(command)
    assert stopped.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"interrupted: 2 conversations written to {out}; rerun the same command to resume"
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1]
    monkeypatch.setattr(regenerate_module, "EndpointClient", lambda *args: EchoClient([]))
    regenerate_module.main(command)
    assert sorted(json.loads(line)["index"] for line in out.read_text().splitlines()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("flags, words", [
    (["--endpoint", "http://unused", "--max-prompt-tokens", "8", "--device", "cpu"],
     "--endpoint answers with a running server, whose settings are its own: --max-prompt-tokens, --device would be "
     "ignored"),
    (["--target", "unused", "--model", "m"], "--target answers in-process: --model would be ignored"),
    (["--target", "unused", "--draft-fp8"], "unrecognized arguments: --draft-fp8"),  # no head here
    (["--target", "unused", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--target", "unused", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--target", "unused", "--limit", "-1"], "--limit must be at least 1, got -1"),
])
def test_flags_are_checked_before_anything_runs(tmp_path, capsys, flags, words):
    """A --max-new-tokens of 0 refused every prompt, which listed every conversation as dropped for good."""
    with pytest.raises(SystemExit) as stopped:  # the target "unused" would raise FileNotFoundError if loaded
        regenerate_module.main(["--data", "unused", "--output", str(tmp_path / "out.jsonl"), *flags])
    assert stopped.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl.dropped").exists()


def test_a_damaged_output_is_a_usage_error_before_the_target_loads(tmp_path, capsys):
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data.write_text(json.dumps({"messages": conv("q", "a")}) + "\n")
    out.write_text('{not json\n{"index": 0, "messages": []}\n')
    with pytest.raises(SystemExit) as stopped:
        regenerate_module.main(["--data", str(data), "--output", str(out), "--target", "unused"])
    assert stopped.value.code == 2 and "--output: " in (err := capsys.readouterr().err) and "line 1" in err


def test_data_the_reader_cannot_read_is_a_usage_error_before_the_target_loads(tmp_path, capsys):
    """A --data file that is not UTF-8 is named, with its line, before the target loads (a traceback after it did)."""
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(json.dumps({"messages": conv("q", "a")}).encode() + b"\n" + '{"messages": "caf\u00e9"}\n'.encode(
        "latin-1"))
    with pytest.raises(SystemExit) as stopped:  # the target "unused" would raise FileNotFoundError if loaded
        regenerate_module.main(["--data", str(data), "--output", str(tmp_path / "out.jsonl"), "--target", "unused"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"--data: {data}: line 2 (byte" in err and "not UTF-8" in err


@pytest.mark.parametrize("make, words", [
    (lambda path: path.write_text('{"messages": [{"role": "alien", "content": "x"}]}\n'), "no usable conversation"),
    (lambda path: path.mkdir(), "Is a directory"),
])
def test_data_without_a_conversation_is_a_usage_error_before_the_target_loads(tmp_path, capsys, make, words):
    data = tmp_path / "in.jsonl"
    make(data)
    with pytest.raises(SystemExit) as stopped:  # the target "unused" would raise FileNotFoundError if loaded
        regenerate_module.main(["--data", str(data), "--output", str(tmp_path / "out.jsonl"), "--target", "unused"])
    assert stopped.value.code == 2 and "--data" in (err := capsys.readouterr().err) and words in err


def test_a_compressed_output_name_is_a_usage_error(tmp_path, capsys):
    """Regeneration appends plain lines: an output named .gz would then be unreadable to every reader (which
    decompresses by suffix), so it is refused before anything is read or loaded; compressed data files are read."""
    data = tmp_path / "in.jsonl.gz"
    data.write_bytes(gzip.compress((json.dumps({"messages": conv("q", "a")}) + "\n").encode()))
    with pytest.raises(SystemExit) as stopped:  # the target "unused" would raise FileNotFoundError if loaded
        regenerate_module.main(["--data", str(data), "--output", str(tmp_path / "out.jsonl.gz"), "--target", "unused"])
    assert stopped.value.code == 2 and "--output" in (err := capsys.readouterr().err) and "plain JSONL" in err
    todo, done, read = regenerate_module.pending(data, tmp_path / "out.jsonl")
    assert len(todo) == 1 and not done


def test_a_finished_output_loads_no_model(tmp_path, capsys):
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data.write_text(json.dumps({"messages": conv("q", "a")}) + "\n")
    out.write_text(json.dumps({"index": 0, "place": "line 1", "messages": conv("q", "b")}) + "\n")
    regenerate_module.main(["--data", str(data), "--output", str(out), "--target", "unused"])  # would raise if loaded
    assert "nothing to regenerate" in capsys.readouterr().out


def test_an_unreachable_endpoint_is_named_without_a_traceback(tmp_path, capsys):
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"messages": conv("q", "a")}) + "\n")
    with pytest.raises(SystemExit) as stopped:  # nothing listens on port 9
        regenerate_module.main(["--data", str(data), "--output", str(tmp_path / "o.jsonl"),
                                "--endpoint", "http://127.0.0.1:9/v1"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "error: http://127.0.0.1:9/v1: GET /models failed" in err
    assert "resume" not in err  # nothing ran


def test_missing_data_is_a_usage_error_before_the_target_loads(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(SystemExit) as stopped:  # the target "unused" would raise FileNotFoundError if loaded
        regenerate_module.main(["--data", str(missing), "--output", str(tmp_path / "out.jsonl"), "--target", "unused"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"argument --data: data '{missing}' is neither an existing path" in err


def test_a_backend_the_device_cannot_run_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """--attention flashinfer on a CPU: a usage error naming the need (a ValueError traceback before)."""
    from eyas.common.architectures import random_target

    target = random_target("tiny", torch.float32, "cpu")
    monkeypatch.setattr(regenerate_module, "load_models_for", lambda *args, **kwargs: (target, None, None, None))
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"messages": conv("q", "old")}) + "\n")
    with pytest.raises(SystemExit) as stopped:
        regenerate_module.main(["--data", str(data), "--output", str(tmp_path / "out.jsonl"), "--target", "t",
                                "--attention", "flashinfer", "--device", "cpu"])
    assert stopped.value.code == 2 and "the flashinfer attention backend needs a CUDA device" in (
        capsys.readouterr().err)


def test_engine_client_is_the_target_greedy_answer(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    # A tiny random target over SmolLM2's vocabulary, so its real tokenizer and chat template apply.
    make_hf_model("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2
                  ).save_pretrained(tmp_path)
    target = TargetModel.from_pretrained(tmp_path)
    engine = Engine(target, None, EngineConfig(block_size=8, num_blocks=256))
    stops = set(stop_token_ids(tok))
    prompts = [conv("Hello there"), conv("Name a colour, then explain it at length.")]
    expected = [tok.decode([t for t in greedy_tokens(target, render_chat(tok, p), 12, stop_ids=stops)
                            if t not in stops]).strip() for p in prompts]
    # Both pending at once, answered as they finish; a prompt past max_prompt_tokens is refused without running.
    n = len(render_chat(tok, prompts[0]))
    client = EngineClient(engine, tok, SamplingParams(temperature=0), 12, max_prompt_tokens=n)
    first, refused = client.answer(prompts)
    assert first.text == expected[0] and refused is None
    client = EngineClient(engine, tok, SamplingParams(temperature=0), 12)
    assert [a.text for a in client.answer(prompts)] == expected


def test_engine_client_answers_without_special_tokens(smollm2_tokenizer, tmp_path):
    """An answer holding a chat marker the model emitted reads as the HTTP API shows it: the marker dropped."""
    tok = smollm2_tokenizer
    make_hf_model("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2
                  ).save_pretrained(tmp_path)
    engine = Engine(TargetModel.from_pretrained(tmp_path), None, EngineConfig(block_size=8, num_blocks=64))
    client = EngineClient(engine, tok, SamplingParams(temperature=0), 12)
    request = client.submit(conv("Hello there"))
    words = tok("Hi there", add_special_tokens=False).input_ids
    request.output = [tok.convert_tokens_to_ids("<|im_start|>")] + words + [*stop_token_ids(tok)][:1]
    engine.abort(request)  # as if it had ended with those tokens
    [(handle, answer)] = client.collect()
    assert handle is request and answer.text == "Hi there"


def test_a_bad_line_before_the_last_is_named_not_truncated(tmp_path):
    output = tmp_path / "regen.jsonl"
    good = [json.dumps({"index": i, "messages": []}) + "\n" for i in range(3)]
    output.write_text(good[0] + "{not json\n" + good[1] + good[2][:10])
    with pytest.raises(ValueError, match="line 2"):
        written_indices(output, repair=True)
    assert output.read_text().endswith(good[2][:10])  # nothing truncated
    output.write_text(good[0] + "[1, 2]\n" + good[1])  # JSON, but not an object
    with pytest.raises(ValueError, match="line 2: not a regenerated conversation"):
        written_indices(output)
    output.write_text(good[0] + good[1] + good[2][:10])  # only the last line cut: repaired
    assert written_indices(output, repair=True) == {0, 1} and output.read_text() == good[0] + good[1]
