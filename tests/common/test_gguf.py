"""GGUF targets: strict loading and the RoPE scaling transformers' GGUF reading drops, on tiny files
(tests/gguf_files.py)."""

import math

import numpy as np
import pytest
import torch

from eyas.common.checkpoint import CheckpointError, gguf_parsed_once, load_target, target_config
from eyas.common.config import ConfigError, RopeConfig
from eyas.common.layers import rope_inv_freq

gguf = pytest.importorskip("gguf")

from tests.gguf_files import HEAD_DIM, LAYERS, write_gguf  # noqa: E402  (needs gguf)


def llama3_divisors(factor):
    """llama.cpp's converter's rope_freqs for Llama 3 scaling (HF's defaults but `factor`), computed by its rule."""
    divisors = []
    for i in range(0, HEAD_DIM, 2):
        wavelen = 2 * math.pi * 500000.0 ** (i / HEAD_DIM)
        if wavelen < 8192 / 4:
            divisors.append(1.0)
        elif wavelen > 8192 / 1:
            divisors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return divisors


def test_a_gguf_target_loads_every_tensor(tmp_path):
    """Every parameter loaded, and each holds the file's values (those llama.cpp stores unpermuted: q and k it
    stores permuted for its rotary, which the loader undoes)."""
    path = write_gguf(tmp_path / "full.gguf")
    model = load_target(path)
    assert model.config.num_hidden_layers == LAYERS and model.config.rope.type == "default"
    assert not any(p.is_meta for p in model.parameters())
    stored = {t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(str(path)).tensors}
    params = dict(model.named_parameters())
    for name, param in [("token_embd", "model.embed_tokens"), ("output_norm", "model.norm"),
                        ("blk.0.attn_v", "model.layers.0.self_attn.v_proj"),
                        ("blk.1.attn_output", "model.layers.1.self_attn.o_proj"),
                        ("blk.1.ffn_down", "model.layers.1.mlp.down_proj")]:
        assert torch.equal(params[param + ".weight"], stored[name + ".weight"]), name


def test_a_gguf_file_lacking_a_tensor_is_an_error_naming_it(tmp_path):
    path = write_gguf(tmp_path / "drop.gguf", drop=("blk.1.ffn_down.weight",))
    with pytest.raises(CheckpointError, match=r"drop\.gguf: missing tensors model\.layers\.1\.mlp\.down_proj\.weight"):
        load_target(path)


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 and 3.3; Llama 3.2
def test_llama3_rope_freqs_become_llama3_scaling(tmp_path, factor):
    divisors = llama3_divisors(factor)
    assert 1.0 < len(set(divisors)) < HEAD_DIM // 2  # the file's tiny rotary still has all three bands
    rope = target_config(write_gguf(tmp_path / "l3.gguf", rope_freqs=divisors)).rope
    assert (rope.type, rope.factor, rope.theta) == ("llama3", factor, 500000.0)
    served = rope_inv_freq(RopeConfig(theta=500000.0), HEAD_DIM) / rope_inv_freq(rope, HEAD_DIM)
    torch.testing.assert_close(served, torch.tensor(divisors), rtol=1e-5, atol=0)


def test_rope_freqs_of_another_rule_are_an_error(tmp_path):
    path = write_gguf(tmp_path / "odd.gguf", rope_freqs=[1.0] * 4 + [2.0] * 2 + [8.0] * 2)
    with pytest.raises(ConfigError, match=r"odd\.gguf \(rope_freqs\.weight\): its 8 frequency divisors are not"):
        target_config(path)


def test_linear_rope_scaling_metadata_is_read_and_others_refused(tmp_path):
    rope = target_config(write_gguf(tmp_path / "linear.gguf", scaling=("linear", 4.0))).rope
    assert (rope.type, rope.factor) == ("linear", 4.0)
    with pytest.raises(ConfigError, match=r"yarn.gguf: RoPE scaling 'yarn' \(llama.rope.scaling.type\)"):
        target_config(write_gguf(tmp_path / "yarn.gguf", scaling=("yarn", 4.0)))


def test_a_load_parses_a_gguf_file_once(tmp_path, monkeypatch):
    """transformers parses the file for the config and again for the tensors, and eyas for the RoPE scaling: within
    `gguf_parsed_once` (which `load_target` and `target_config` enter) one reader serves them all, and a second load
    inside it parses nothing more; outside, each load parses the file afresh."""
    path = write_gguf(tmp_path / "once.gguf")
    parsed = []
    made = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: parsed.append(args[0]) or made(*args, **kwargs))
    load_target(path)
    assert len(parsed) == 1
    with gguf_parsed_once():
        target_config(path)
        load_target(path)
    assert len(parsed) == 2
    target_config(path)
    assert len(parsed) == 3 and gguf.GGUFReader is not made  # the count's own reader back in place
