"""The target decoder matches transformers' own classes; tree masks give the same logits as plain paths."""

import pytest
import torch

from eyas.common.attention import CausalAttention, MaskedAttention
from eyas.common.config import ConfigError, TargetConfig
from eyas.common.target import TargetModel
from tests.conftest import FAMILIES, hf_config_dict

TOL = 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parity_with_transformers(family, hf_checkpoint):
    path, hf = hf_checkpoint(family)
    model = TargetModel.from_pretrained(path)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 37))
    pos = torch.arange(37).expand(2, -1)
    n = model.config.num_hidden_layers
    with torch.no_grad():
        ref = hf(input_ids=ids, output_hidden_states=True)
        out = model(ids, pos, CausalAttention(), aux_layers=tuple(range(n + 1)))
        logits = model.logits(out.hidden)
    # HF hidden_states[i] is the stream entering layer i, except the last, which is after the final norm.
    ours = out.aux.split(model.config.hidden_size, dim=-1)
    for i in range(n):
        assert (ours[i] - ref.hidden_states[i]).abs().max() <= TOL, f"hidden state entering layer {i}"
    assert (out.hidden - ref.hidden_states[n]).abs().max() <= TOL
    assert (logits - ref.logits).abs().max() <= TOL


@pytest.mark.parametrize("family, fields, context", [
    ("qwen2", {"sliding_window": 1024}, 8192),  # no use_sliding_window
    ("qwen3", {"sliding_window": 1024, "use_sliding_window": True}, 8192),  # 6 layers: none from max_window_layers 28
    ("qwen3", {"sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 2}, 1024),
    ("qwen2", {"sliding_window": 1024, "use_sliding_window": True, "layer_types": ["full_attention"] * 6}, 8192),
    ("mistral", {"sliding_window": 1024, "use_sliding_window": False}, 1024),  # no switch
    ("mistral", {"sliding_window": 1024}, 1024),
    ("mistral", {"sliding_window": None}, 8192),
    ("llama", {"sliding_window": 1024, "use_sliding_window": True}, 8192),
])
def test_sliding_window_caps_the_context_only_where_a_layer_slides(family, fields, context):
    """As transformers reads them: Qwen's window applies only with use_sliding_window, and only to the layers its
    layer_types (by default max_window_layers) marks; Mistral's always; Llama's never."""
    from transformers import AutoConfig

    values = hf_config_dict(family, max_position_embeddings=8192, **fields)
    cfg = TargetConfig.from_hf(values, source="config.json")
    assert cfg.max_position_embeddings == context
    hf = AutoConfig.for_model(**values)
    slides = (family != "llama" and hf.sliding_window is not None
              and "sliding_attention" in (getattr(hf, "layer_types", None) or ["sliding_attention"]))
    assert slides == (context == 1024)


def test_a_mistral_config_without_a_window_field_slides_at_transformers_default():
    from transformers import AutoConfig

    values = {k: v for k, v in hf_config_dict("mistral", max_position_embeddings=8192).items() if k != "sliding_window"}
    assert AutoConfig.for_model(**values).sliding_window == 4096
    assert TargetConfig.from_hf(values, source="config.json").max_position_embeddings == 4096


def test_rope_parameters_theta_wins_over_a_top_level_one_as_in_transformers():
    from transformers import AutoConfig

    values = hf_config_dict("llama", rope_theta=10000.0, rope_scaling=None,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert AutoConfig.for_model(**values).rope_parameters["rope_theta"] == 1e6
    assert TargetConfig.from_hf(values, source="config.json").rope.theta == 1e6


@pytest.mark.parametrize("family, fields, words", [
    ("llama", {"rope_scaling": [8.0]}, "field 'rope_scaling' should be an object, got list [8.0]"),
    ("llama", {"rope_parameters": "llama3"}, "field 'rope_parameters' should be an object, got str"),
    ("llama", {"text_config": 3}, "field 'text_config' should be an object, got int 3"),
    ("mistral", {"sliding_window": True}, "field 'sliding_window' should be a positive integer or null, got True"),
    ("mistral", {"sliding_window": 0}, "field 'sliding_window' should be a positive integer or null, got 0"),
    ("llama", {"num_key_value_heads": 0}, "field 'num_key_value_heads' must be >= 1, got 0"),
    ("llama", {"num_attention_heads": 0, "head_dim": 16}, "field 'num_attention_heads' must be >= 1, got 0"),
    ("llama", {"num_hidden_layers": 0}, "field 'num_hidden_layers' must be >= 1, got 0"),
    # A draft head given as the target failed on its tensors' names (or its aux layers), not on what it is.
    ("llama", {"architectures": ["LlamaForCausalLMEagle3"]}, "a draft head's config (architectures ['LlamaForC"),
    ("llama", {"architectures": ["LlamaForCausalLM"], "draft_vocab_size": 32000}, "a draft head's config"),
])
def test_malformed_config_values_are_named(family, fields, words):
    """Each used to fail far from the file (a TypeError, a ZeroDivisionError, or blame on another field)."""
    with pytest.raises(ConfigError) as refused:
        TargetConfig.from_hf(hf_config_dict(family, **fields), source="t/config.json")
    assert str(refused.value).startswith("t/config.json") and words in str(refused.value)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_causal_lm_class_is_the_one_transformers_maps_the_family_to(family):
    """The class named after model_type (what a GGUF target's speculators export names as verifier) is the one
    transformers builds for it: a family whose class is named otherwise fails here."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = TargetConfig.from_hf(hf_config_dict(family), source="config.json")
    assert cfg.causal_lm_class == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]


@pytest.mark.parametrize("layers, ok", [(2, False), (3, True)])
def test_default_aux_layers_need_three_target_layers(layers, ok):
    from eyas.common.eagle3 import Eagle3Config

    target = TargetConfig.from_hf(hf_config_dict("llama", num_hidden_layers=layers), source="config.json")
    head = Eagle3Config.for_target(target, 64)
    if ok:
        assert head.aux_layers_for(target) == (2, 1, 0)
    else:
        with pytest.raises(ValueError, match=r"needs at least 3 layers"):
            head.aux_layers_for(target)


def test_aux_layers_default(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    model = TargetModel.from_pretrained(path)
    assert model.config.default_aux_layers == (2, 3, 3)
    ids = torch.randint(0, 100, (1, 5))
    out = model(ids, torch.arange(5)[None], CausalAttention(), aux_layers=model.config.default_aux_layers)
    assert out.aux.shape == (1, 5, 3 * model.config.hidden_size)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_mask_equals_path(family, hf_checkpoint):
    """Prefix of 5 tokens, then a tree of 6 nodes; each node's logits equal those of its root path run causally.

    tree (parents):  5 -> {6, 7};  6 -> {8, 9};  7 -> {10}
    """
    path, _ = hf_checkpoint(family)
    model = TargetModel.from_pretrained(path)
    torch.manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (1, 11))
    parent = {6: 5, 7: 5, 8: 6, 9: 6, 10: 7}
    depth = {5: 0}
    for node in range(6, 11):
        depth[node] = depth[parent[node]] + 1
    mask = torch.zeros(11, 11, dtype=torch.bool)
    mask[:, :5] = torch.ones(11, 5, dtype=torch.bool).tril()  # causal prefix
    for node in range(5, 11):
        a = node
        while True:
            mask[node, a] = True
            if a == 5:
                break
            a = parent[a]
    positions = torch.tensor([0, 1, 2, 3, 4] + [5 + depth[n] for n in range(5, 11)])[None]
    with torch.no_grad():
        tree_logits = model.logits(model(ids, positions, MaskedAttention(mask[None])).hidden)[0]
        for node in range(5, 11):
            chain = [node]
            while chain[-1] != 5:
                chain.append(parent[chain[-1]])
            seq = list(range(5)) + chain[::-1]
            path_ids = ids[:, seq]
            ref = model.logits(model(path_ids, torch.arange(len(seq))[None], CausalAttention()).hidden)[0, -1]
            assert (tree_logits[node] - ref).abs().max() <= TOL, f"tree node {node}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_projections_give_the_same_outputs(family, hf_checkpoint):
    """q/k/v and gate/up joined (what the engine serves; with q/k/v biases for qwen2, q/k norms for qwen3)."""
    from eyas.common.layers import fuse_projections

    path, _ = hf_checkpoint(family)
    model = TargetModel.from_pretrained(path)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(9).expand(2, -1)
    with torch.no_grad():
        want = model.logits(model(ids, pos, CausalAttention()).hidden)
        fuse_projections(model)
        fuse_projections(model)  # idempotent
        got = model.logits(model(ids, pos, CausalAttention()).hidden)
    names = [name for name, _ in model.named_parameters()]
    assert any("qkv_proj" in n for n in names) and any("gate_up_proj" in n for n in names)
    assert not any(p in n for n in names for p in (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj."))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_folded_norms_give_the_same_outputs(family, hf_checkpoint):
    """Each layer's input and post-attention norm weights folded into the joint q/k/v and gate/up weights (what the
    engine serves): the norms keep only their eps, the outputs are the model's (fp32, so up to its rounding), and
    the aux streams too."""
    from eyas.common.layers import fuse_projections

    path, _ = hf_checkpoint(family)
    model = TargetModel.from_pretrained(path)
    with torch.no_grad():  # norm weights away from 1, so that a fold that drops them is seen
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(norm.weight)))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(9).expand(2, -1)
    aux_layers = model.config.default_aux_layers
    with torch.no_grad():
        want = model(ids, pos, CausalAttention(), aux_layers=aux_layers)
        fuse_projections(model)
        model.fold_norms()
        model.fold_norms()  # idempotent
        got = model(ids, pos, CausalAttention(), aux_layers=aux_layers)
    assert all(layer.input_layernorm.weight is None and layer.post_attention_layernorm.weight is None
               for layer in model.model.layers)
    assert model.model.norm.weight is not None  # the final norm stays whole
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.aux, want.aux, rtol=1e-5, atol=1e-5)
