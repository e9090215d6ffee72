"""Regeneration rewrites assistant turns in order, batches across conversations, and resumes."""

import json

from eyas.common.target import TargetModel
from eyas.data.tokenizer import render_chat, stop_token_ids
from eyas.serve.engine import Engine, EngineConfig
from eyas.serve.generate import greedy_tokens
from eyas.serve.regenerate import engine_replier, regenerate_batch, regenerate_file
from eyas.serve.sampling import SamplingParams
from tests.conftest import make_hf_model


def echo_replier(calls):
    """Replies with the number of messages it saw and the last user text; records each batch."""

    def reply(prompts):
        calls.append(len(prompts))
        return [f"{len(p)}:{p[-1]['content']}" for p in prompts]

    return reply


def conv(*texts):
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


def test_turns_are_rewritten_in_order_across_the_batch():
    calls = []
    out = regenerate_batch([conv("a", "old", "b", "old"), conv("c", "old")], echo_replier(calls))
    assert out == [conv("a", "1:a", "b", "3:b"), conv("c", "1:c")]
    assert calls == [2, 1]  # turn 1 of both conversations in one batch, then turn 3 of the first


def test_empty_reply_ends_the_conversation():
    out = regenerate_batch([conv("a", "x", "b", "y")], lambda prompts: ["" if len(prompts[0]) > 1 else "ok"])
    assert out == [conv("a", "ok")]


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
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4] and calls == [2]
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
    reply = engine_replier(engine, tok, SamplingParams(temperature=0), max_new_tokens=12)
    prompt = conv("Hello there")
    (text,) = reply([prompt])
    stops = set(stop_token_ids(tok))
    expected = [t for t in greedy_tokens(target, render_chat(tok, prompt), 12, stop_ids=stops) if t not in stops]
    assert text == tok.decode(expected).strip()
    # A prompt past max_prompt_tokens gets no reply (ending its conversation); a shorter one is answered.
    n = len(render_chat(tok, prompt))
    assert engine_replier(engine, tok, SamplingParams(temperature=0), 12, max_prompt_tokens=n - 1)([prompt]) == [""]
    assert engine_replier(engine, tok, SamplingParams(temperature=0), 12, max_prompt_tokens=n)([prompt]) == [text]
