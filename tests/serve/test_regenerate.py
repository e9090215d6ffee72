"""Regeneration rewrites assistant turns in order, keeps conversations in flight independently, and resumes."""

import json

from eyas.common.target import TargetModel
from eyas.data.tokenizer import render_chat, stop_token_ids
from eyas.serve.engine import Engine, EngineConfig
from eyas.serve.generate import greedy_tokens
from eyas.serve.regenerate import EngineReplier, Replier, regenerate, regenerate_file
from eyas.serve.sampling import SamplingParams
from tests.conftest import make_hf_model


class EchoReplier(Replier):
    """Answers "<messages seen>:<last user text>" (or `answer(prompt)`); `collect` returns the oldest pending
    prompt only, so conversations finish out of step. Records each prompt's length in `calls`."""

    def __init__(self, calls, answer=None):
        self.calls, self.pending = calls, []
        self.answer = answer or (lambda p: f"{len(p)}:{p[-1]['content']}")

    def submit(self, prompt):
        self.calls.append(len(prompt))
        handle = object()
        self.pending.append((handle, self.answer(prompt)))
        return handle

    def collect(self):
        return [self.pending.pop(0)]


def echo_replier(calls):
    return EchoReplier(calls)


def conv(*texts):
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


def test_turns_are_rewritten_in_order_and_conversations_refill():
    calls = []
    convs = [conv("a", "old", "b", "old"), conv("c", "old"), conv("d", "old")]
    out = list(regenerate(enumerate(convs), echo_replier(calls), in_flight=2))
    # a's first reply comes back first: a asks for its second turn at once, c's reply then finishes c,
    # whose place goes to d.
    assert out == [(1, conv("c", "1:c")), (0, conv("a", "1:a", "b", "3:b")), (2, conv("d", "1:d"))]
    assert calls == [1, 1, 3, 1]


def test_empty_reply_ends_the_conversation():
    replier = EchoReplier([], answer=lambda p: "" if len(p) > 1 else "ok")
    assert list(regenerate([(0, conv("a", "x", "b", "y"))], replier, in_flight=4)) == [(0, conv("a", "ok"))]


def test_file_resumes_after_interruption(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"messages": conv(f"q{i}", "old")}) + "\n" for i in range(5)))
    out = tmp_path / "out.jsonl"
    assert regenerate_file(data, out, echo_replier([]), batch_size=2, limit=3) == 3
    with open(out, "a") as f:
        f.write('{"index": 3, "mess')  # a line cut by a kill
    lines = out.read_text().splitlines()[:3]
    out.write_text("".join(line + "\n" for line in lines))
    calls = []
    assert regenerate_file(data, out, echo_replier(calls), batch_size=2) == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4] and calls == [1, 1]  # only the two left ran
    assert rows[4]["messages"] == conv("q4", "1:q4")


def test_shards_split_the_conversations(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"messages": conv(f"q{i}", "old")}) + "\n" for i in range(5)))
    indices = []
    for i in range(2):
        out = tmp_path / f"shard{i}.jsonl"
        regenerate_file(data, out, echo_replier([]), batch_size=2, shard=(i, 2))
        indices.append([json.loads(line)["index"] for line in out.read_text().splitlines()])
    assert indices == [[0, 2, 4], [1, 3]]


def test_engine_replier_is_the_target_greedy_answer(smollm2_tokenizer, tmp_path):
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
    # Both pending at once, answered as they finish; a prompt past max_prompt_tokens gets "" without running.
    n = len(render_chat(tok, prompts[0]))
    replier = EngineReplier(engine, tok, SamplingParams(temperature=0), 12, max_prompt_tokens=n)
    handles = [replier.submit(p) for p in prompts]
    answers = {}
    while len(answers) < 2:
        answers.update(replier.collect())
    assert [answers[h] for h in handles] == [expected[0], ""]
    replier = EngineReplier(engine, tok, SamplingParams(temperature=0), 12)
    handles = [replier.submit(p) for p in prompts]
    answers = {}
    while len(answers) < 2:
        answers.update(replier.collect())
    assert [answers[h] for h in handles] == expected
