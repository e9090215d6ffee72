"""Named target architectures, for speed measurements with random weights (a step's time does not depend
on the weights' values) and for tests.

    target = random_target("llama-3.1-8b", torch.bfloat16, "cuda")
"""

from __future__ import annotations

import torch

from .config import TargetConfig
from .target import TargetModel

# Hugging Face config.json fields of each architecture.
ARCHITECTURES = {
    "tiny": {
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
    },
    "smollm2-135m": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
}


def architecture_config(arch: str) -> TargetConfig:
    return TargetConfig.from_hf(ARCHITECTURES[arch], source=f"architecture '{arch}'")


@torch.no_grad()
def random_target(arch: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> TargetModel:
    """A target of architecture `arch` with N(0, 0.02) weights, built directly on `device` in `dtype`."""
    cfg = architecture_config(arch)
    with torch.device("meta"):
        model = TargetModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        p.normal_(0.0, 0.02, generator=generator)
    model.rotary.reset_parameters(device)
    return model.eval()
