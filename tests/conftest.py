"""Shared fixtures: tiny random Hugging Face checkpoints of each Llama family, written to disk."""

import pytest
import torch

TINY = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

# model_type -> extra config fields that exercise that family's traits.
FAMILIES = {
    "llama": dict(
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64),
        tie_word_embeddings=False,
    ),
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(rope_theta=1000000.0, head_dim=32, tie_word_embeddings=False),
    "mistral": dict(rope_theta=10000.0, head_dim=16, tie_word_embeddings=False, sliding_window=None),
}


def hf_config_dict(family: str, **overrides) -> dict:
    return {"model_type": family, **TINY, **FAMILIES[family], **overrides}


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A tiny random transformers model of `family` (fp32, eval mode, eager attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = hf_config_dict(family, **overrides)
    hf_cfg = AutoConfig.for_model(**cfg)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():  # random biases and norm weights, so that every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """family -> (directory of a saved tiny HF model, the HF model)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = make_hf_model(family)
            path = tmp_path_factory.mktemp(f"hf-{family}")
            model.save_pretrained(path)
            cache[family] = (path, model)
        return cache[family]

    return get


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped, with the reason shown, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (read from its GGUF: seconds, so once per session)."""
    from eyas.common.assets import asset_path
    from eyas.data.tokenizer import load_tokenizer

    return load_tokenizer(asset_path("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def interpreter():
    """Runs a test module's CPU cases of Triton kernels under Triton's interpreter, in one spawned worker for the
    module (`tests/triton_interpreter.py`)."""
    from tests import triton_interpreter  # needs triton: only the modules that take this fixture import it

    with triton_interpreter.worker() as run:
        yield run
