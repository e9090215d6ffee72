"""Draft heads: public checkpoint layouts load and compute what the format means; export -> load is
bit-identical; malformed checkpoints fail with a message that names the culprit."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eyas.common.attention import CausalAttention
from eyas.common.checkpoint import CheckpointError
from eyas.common.config import ConfigError
from eyas.common.eagle import EagleHead
from eyas.common.eagle3 import Eagle3Head
from eyas.common.head_checkpoint import export_speculators, load_draft_head, save_eagle3
from eyas.common.hot_vocab import HotVocab
from eyas.common.target import TargetOutput

H, HEADS, KV, D, FFN, V, DV, HT = 32, 4, 2, 8, 64, 100, 20, 48


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    ang = pos[..., None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, :, None], torch.cat([ang, ang], -1).sin()[:, :, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_attention(t, prefix, x, pos):
    """Causal GQA attention with HF-named weights `prefix.{q,k,v,o}_proj.weight` (independent of eyas)."""
    B, T, _ = x.shape
    q = rope((x @ t[f"{prefix}.q_proj.weight"].T).view(B, T, HEADS, D), pos)
    k = rope((x @ t[f"{prefix}.k_proj.weight"].T).view(B, T, KV, D), pos)
    v = (x @ t[f"{prefix}.v_proj.weight"].T).view(B, T, KV, D)
    k, v = k.repeat_interleave(HEADS // KV, 2), v.repeat_interleave(HEADS // KV, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2).reshape(B, T, -1) @ t[f"{prefix}.o_proj.weight"].T


def ref_mlp(t, prefix, x):
    g, u = x @ t[f"{prefix}.gate_proj.weight"].T, x @ t[f"{prefix}.up_proj.weight"].T
    return (F.silu(g) * u) @ t[f"{prefix}.down_proj.weight"].T


def layer_tensors(prefix, in_features):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    return {
        f"{prefix}.self_attn.q_proj.weight": r(HEADS * D, in_features),
        f"{prefix}.self_attn.k_proj.weight": r(KV * D, in_features),
        f"{prefix}.self_attn.v_proj.weight": r(KV * D, in_features),
        f"{prefix}.self_attn.o_proj.weight": r(H, HEADS * D),
        f"{prefix}.post_attention_layernorm.weight": 1 + r(H),
        f"{prefix}.mlp.gate_proj.weight": r(FFN, H),
        f"{prefix}.mlp.up_proj.weight": r(FFN, H),
        f"{prefix}.mlp.down_proj.weight": r(H, FFN),
    }


LLAMA_FIELDS = dict(
    model_type="llama", hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, intermediate_size=FFN,
    rms_norm_eps=1e-6, max_position_embeddings=256, num_hidden_layers=1, vocab_size=V, rope_theta=10000.0,
    hidden_act="silu", tie_word_embeddings=False,
)


def write_public_eagle3(path, architecture="LlamaForCausalLMEagle3", **config_overrides):
    """An EAGLE-3 head directory exactly as SpecForge / SGLang's public heads lay it out."""
    g = torch.Generator().manual_seed(1)
    hot = torch.randperm(V, generator=g)[:DV].sort().values
    t = {
        "fc.weight": torch.randn(H, 3 * HT, generator=g) * 0.1,
        "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        **layer_tensors("midlayer", 2 * H),
        "norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "lm_head.weight": torch.randn(DV, H, generator=g) * 0.2,
        "d2t": hot - torch.arange(DV),
        "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, hot, True),
        "embed_tokens.weight": torch.randn(V, H, generator=g),  # some heads ship it; the target's is used
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    cfg = {**LLAMA_FIELDS, "architectures": [architecture], "draft_vocab_size": DV, "target_hidden_size": HT,
           **config_overrides}
    (path / "config.json").write_text(json.dumps(cfg))
    return t


def write_public_eagle(path, with_bias=True):
    """An EAGLE-1/2 head directory as SafeAILab's releases lay it out (layer 0 has no input_layernorm)."""
    g = torch.Generator().manual_seed(2)
    t = {"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.1, **layer_tensors("layers.0", H)}
    if with_bias:
        t["fc.bias"] = 0.1 * torch.randn(H, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    cfg = {**LLAMA_FIELDS, "architectures": ["LlamaForCausalLMEagle"], "bias": with_bias}
    (path / "config.json").write_text(json.dumps(cfg))
    return t


def inputs(B=2, T=7, width=H):
    g = torch.Generator().manual_seed(3)
    return torch.randn(B, T, H, generator=g), torch.randn(B, T, width, generator=g), torch.arange(T).expand(B, -1)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_public_eagle3_layout_loads_and_computes_the_format(tmp_path, norm_before_residual):
    t = write_public_eagle3(tmp_path / "head", norm_before_residual=norm_before_residual)
    head = load_draft_head(tmp_path / "head")
    assert isinstance(head, Eagle3Head)
    embeds, aux, pos = inputs(width=3 * HT)
    with torch.no_grad():
        out = head.step(embeds, head.project_target(TargetOutput(hidden=None, aux=aux)), pos, CausalAttention())
        logits = head.logits(out)
    # The format's meaning, written out independently of eyas:
    h = aux @ t["fc.weight"].T
    normed = rms(h, t["midlayer.hidden_norm.weight"])
    x = torch.cat([rms(embeds, t["midlayer.input_layernorm.weight"]), normed], -1)
    r = (normed if norm_before_residual else h) + ref_attention(t, "midlayer.self_attn", x, pos)  # the residual
    ref_out = r + ref_mlp(t, "midlayer.mlp", rms(r, t["midlayer.post_attention_layernorm.weight"]))
    ref_logits = rms(ref_out, t["norm.weight"]) @ t["lm_head.weight"].T
    assert (out - ref_out).abs().max() < 1e-4
    assert (logits - ref_logits).abs().max() < 1e-4
    assert torch.equal(head.hot_vocab.to_target(torch.arange(DV)), t["d2t"] + torch.arange(DV))


def test_original_llama_architecture_with_draft_vocab_is_eagle3(tmp_path):
    write_public_eagle3(tmp_path / "head", architecture="LlamaForCausalLM")
    assert isinstance(load_draft_head(tmp_path / "head"), Eagle3Head)


def test_sglang_layer_ids_are_layer_outputs(tmp_path):
    write_public_eagle3(tmp_path / "head", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 15, 28]})
    head = load_draft_head(tmp_path / "head")
    assert head.config.aux_layers == (2, 16, 29)  # the streams entering these layers
    save_eagle3(head, tmp_path / "out")
    written = json.loads((tmp_path / "out/config.json").read_text())
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]


@pytest.mark.parametrize("nested, aux", [
    ([1, 15, 28], (2, 16, 29)),  # from 1: layer outputs (every SGLang)
    ([2, 30, 58], (2, 30, 58)),  # from past 1: the layers the streams enter (SGLang since its PR 25454)
    ([28, 1, 15], (1, 15, 28)),  # out of order: its first id decides, as in SGLang; fused in layer order
])
def test_sglang_layer_ids_read_by_sglang_s_rule(tmp_path, nested, aux):
    write_public_eagle3(tmp_path / "head", eagle_config={"eagle_aux_hidden_state_layer_ids": nested})
    assert load_draft_head(tmp_path / "head").config.aux_layers == aux


@pytest.mark.parametrize("aux, nested", [((2, 16, 29), [1, 15, 28]), ((3, 8, 13), [3, 8, 13])])
def test_exported_layer_ids_read_alike_in_both_engines(tmp_path, aux, nested):
    """vLLM reads the top-level list (the layers the streams enter); SGLang the nested one, shifting a list that
    starts at 1 and no other: either gives the head's streams."""
    write_public_eagle3(tmp_path / "head", eagle_aux_hidden_state_layer_ids=list(aux))
    head = load_draft_head(tmp_path / "head")
    save_eagle3(head, tmp_path / "out")
    written = json.loads((tmp_path / "out/config.json").read_text())
    assert written["eagle_aux_hidden_state_layer_ids"] == list(aux)
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == nested
    del written["eagle_aux_hidden_state_layer_ids"]  # as SGLang sees it: the nested list alone
    (tmp_path / "out/config.json").write_text(json.dumps(written))
    assert load_draft_head(tmp_path / "out").config.aux_layers == aux


def test_layer_ids_from_layer_1_are_refused_at_export(tmp_path):
    """SGLang reads a nested list starting at 1 as layer outputs: the stream entering layer 1 has no form there."""
    write_public_eagle3(tmp_path / "head", eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    with pytest.raises(ValueError, match=r"aux layers \(1, 2, 3\): SGLang's config cannot name the stream entering"):
        save_eagle3(load_draft_head(tmp_path / "head"), tmp_path / "out")


@pytest.mark.parametrize("architecture", ["Eagle3LlamaForCausalLM", "Qwen2ForCausalLMEagle3"])
def test_other_names_of_the_eagle3_layout_load(tmp_path, architecture):
    """vLLM's class name (AngelSlim's heads) and SpecForge's Qwen2 one: the same layout."""
    write_public_eagle3(tmp_path / "head", architecture=architecture)
    assert isinstance(load_draft_head(tmp_path / "head"), Eagle3Head)


@pytest.mark.parametrize("flag", ["norm_output", "norm_before_fc", "fc_norm"])
def test_eagle3_variants_eyas_does_not_compute_are_refused(tmp_path, flag):
    """Flags of variants whose layer computes otherwise and that add no tensor: such a head loaded silently."""
    write_public_eagle3(tmp_path / "head", **{flag: True})
    with pytest.raises(ConfigError, match=f"field '{flag}' is set: an EAGLE-3 variant eyas does not serve"):
        load_draft_head(tmp_path / "head")


def test_save_eagle3_names_the_dtype_and_refuses_vllm_s_variant(tmp_path):
    """SGLang reads a config without a dtype as float32 (served as float16); it ignores norm_before_residual."""
    write_public_eagle3(tmp_path / "head")
    save_eagle3(load_draft_head(tmp_path / "head", dtype=torch.bfloat16), tmp_path / "out")
    assert json.loads((tmp_path / "out/config.json").read_text())["torch_dtype"] == "bfloat16"
    write_public_eagle3(tmp_path / "normed", norm_before_residual=True)
    with pytest.raises(ValueError, match="norm_before_residual is served by vLLM alone: write it with export_spec"):
        save_eagle3(load_draft_head(tmp_path / "normed"), tmp_path / "out2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_then_load_is_bit_identical(tmp_path, dtype):
    write_public_eagle3(tmp_path / "head")
    head = load_draft_head(tmp_path / "head", dtype=dtype)
    save_eagle3(head, tmp_path / "out")
    again = load_draft_head(tmp_path / "out")
    assert again.config == head.config
    a, b = head.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    keys = set(load_file(str(tmp_path / "out/model.safetensors")))
    assert "embed_tokens.weight" not in keys and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= keys


def test_speculators_export_round_trip(tmp_path):
    write_public_eagle3(tmp_path / "head", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 15, 28]})
    head = load_draft_head(tmp_path / "head")
    export_speculators(head, tmp_path / "spec", verifier="org/target", verifier_architectures=["LlamaForCausalLM"])
    cfg = json.loads((tmp_path / "spec/config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert "eagle_aux_hidden_state_layer_ids" not in cfg["transformer_layer_config"]
    assert cfg["transformer_layer_config"]["vocab_size"] == V and cfg["draft_vocab_size"] == DV
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    keys = set(load_file(str(tmp_path / "spec/model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in keys and not any(k.startswith("midlayer.") for k in keys)
    again = load_draft_head(tmp_path / "spec")
    assert again.config == head.config
    for k, v in head.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    del cfg["norm_before_residual"]  # vLLM, which serves this layout, takes it as true where left out
    (tmp_path / "spec/config.json").write_text(json.dumps(cfg))
    assert load_draft_head(tmp_path / "spec").config.norm_before_residual is True


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.update({"midlayer.mlp.up.weight": t.pop("midlayer.mlp.up_proj.weight")}),
         "missing tensor 'midlayer.mlp.up_proj.weight'"),
        (lambda t: t.update({"midlayer.mlp.up.weight": t.pop("midlayer.mlp.up_proj.weight")}),
         "unexpected tensor 'midlayer.mlp.up.weight'"),
        (lambda t: t.update({"fc.weight": t["fc.weight"][:, :-1].contiguous()}), "tensor 'fc.weight' has shape"),
        (lambda t: t.update({"d2t": t["d2t"].float()}), "tensor 'd2t' has dtype"),
        (lambda t: t.update({"t2d": ~t["t2d"]}), "'t2d' disagrees with 'd2t'"),
    ],
)
def test_malformed_eagle3_checkpoint_names_the_tensor(tmp_path, edit, message):
    t = write_public_eagle3(tmp_path / "head")
    edit(t)
    save_file(t, str(tmp_path / "head/model.safetensors"))
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_draft_head(tmp_path / "head")


@pytest.mark.parametrize("cut", [4, -16])  # the file cut inside its header length, inside its last tensor
def test_a_truncated_weights_file_is_named(tmp_path, cut):
    write_public_eagle3(tmp_path / "head")
    weights = tmp_path / "head/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:cut])
    with pytest.raises(CheckpointError, match=f"{weights}: not a readable safetensors file"):
        load_draft_head(tmp_path / "head")


@pytest.mark.parametrize("fields, words", [
    ({"eagle_config": [1, 15, 28]}, "field 'eagle_config' should be an object, got list"),
    ({"draft_vocab_size": 0}, "field 'draft_vocab_size' must be >= 1, got 0"),
])
def test_malformed_head_config_values_are_named(tmp_path, fields, words):
    write_public_eagle3(tmp_path / "head", **fields)
    with pytest.raises(ConfigError, match=words):
        load_draft_head(tmp_path / "head")


def test_config_field_of_wrong_type_is_named(tmp_path):
    write_public_eagle3(tmp_path / "head", hidden_size="32")
    with pytest.raises(ConfigError, match="field 'hidden_size'"):
        load_draft_head(tmp_path / "head")


def test_public_eagle_layout_loads_and_computes_the_format(tmp_path):
    t = write_public_eagle(tmp_path / "head")
    lm_head = torch.randn(V, H)  # the target's
    head = load_draft_head(tmp_path / "head")
    assert isinstance(head, EagleHead)
    head.attach_lm_head(lm_head)
    embeds, feats, pos = inputs()
    with torch.no_grad():
        out = head.step(embeds, feats, pos, CausalAttention())
        logits = head.logits(out)
    x = torch.cat([embeds, feats], -1) @ t["fc.weight"].T + t["fc.bias"]
    x = x + ref_attention(t, "layers.0.self_attn", x, pos)
    ref_out = x + ref_mlp(t, "layers.0.mlp", rms(x, t["layers.0.post_attention_layernorm.weight"]))
    assert (out - ref_out).abs().max() < 1e-4
    assert (logits - ref_out @ lm_head.T).abs().max() < 1e-4


def test_eagle_head_with_fr_spec_token_map(tmp_path):
    write_public_eagle(tmp_path / "head", with_bias=False)
    freq = [7, 3, 99, 0, 42]
    HotVocab(torch.tensor(freq), V).save_token_map(tmp_path / "freq_5.pt")
    head = load_draft_head(tmp_path / "head", token_map=tmp_path / "freq_5.pt")
    lm_head = torch.randn(V, H)
    head.attach_lm_head(lm_head)
    out = torch.randn(1, 3, H)
    assert torch.equal(head.logits(out), out @ lm_head[freq].T)
    assert head.hot_vocab.to_target(torch.tensor([0, 2])).tolist() == [7, 99]


def test_eagle3_head_with_fr_spec_token_map(tmp_path):
    """A map restricts an EAGLE-3 head's own draft vocabulary: the kept tokens' lm_head rows, in the head's order
    (the map's ids outside the head's vocabulary are ignored); saved, it loads as the smaller head it is."""
    t = write_public_eagle3(tmp_path / "head")
    hot = (t["d2t"] + torch.arange(DV)).tolist()  # the head's target ids, ascending
    others = [i for i in range(V) if i not in hot]
    freq = [hot[7], others[0], hot[2], hot[11]]  # most frequent first; the second is not the head's
    HotVocab(torch.tensor(freq), V).save_token_map(tmp_path / "freq_4.pt")
    full = load_draft_head(tmp_path / "head")
    head = load_draft_head(tmp_path / "head", token_map=tmp_path / "freq_4.pt")
    assert head.config.draft_vocab_size == 3 and head.hot_vocab.hot_ids.tolist() == [hot[2], hot[7], hot[11]]
    out = torch.randn(1, 3, H)
    torch.testing.assert_close(head.logits(out), full.logits(out)[..., [2, 7, 11]], rtol=1e-6, atol=1e-6)
    save_eagle3(head, tmp_path / "small")
    again = load_draft_head(tmp_path / "small")
    assert again.config == head.config and torch.equal(again.logits(out), head.logits(out))
    HotVocab(torch.tensor(others[:3]), V).save_token_map(tmp_path / "none.pt")
    with pytest.raises(ConfigError, match="none.pt, for the head .*holds none of the head's draft tokens"):
        load_draft_head(tmp_path / "head", token_map=tmp_path / "none.pt")


def test_eagle_head_missing_bias_is_named(tmp_path):
    write_public_eagle(tmp_path / "head", with_bias=False)
    cfg = json.loads((tmp_path / "head/config.json").read_text())
    cfg["bias"] = True
    (tmp_path / "head/config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing tensor 'fc.bias'"):
        load_draft_head(tmp_path / "head")


def test_aux_layers_must_exist_in_the_target(hf_checkpoint):
    from eyas.common.eagle3 import Eagle3Config
    from eyas.common.target import TargetModel

    target = TargetModel.from_pretrained(hf_checkpoint("llama")[0])  # 6 layers
    assert Eagle3Config.for_target(target.config, 10).aux_layers_for(target.config) == (2, 3, 3)
    with pytest.raises(ValueError, match=r"aux layers \(2, 3, 9\) do not exist"):
        Eagle3Config.for_target(target.config, 10, aux_layers=(2, 3, 9)).aux_layers_for(target.config)


def test_hot_vocab_follows_d2t():
    """The cached hot vocabulary is rebuilt when d2t changes (in place or replaced), never stale."""
    from eyas.common.eagle3 import Eagle3Config

    head = Eagle3Head(Eagle3Config(H, HEADS, KV, D, FFN, 1e-6, 256, V, DV, H))
    first = HotVocab(torch.arange(DV), V)
    head.set_hot_vocab(first)
    assert head.hot_vocab is head.hot_vocab and torch.equal(head.hot_vocab.hot_ids, first.hot_ids)
    second = HotVocab(torch.arange(DV) * 2, V)
    head.set_hot_vocab(second)
    assert torch.equal(head.hot_vocab.hot_ids, second.hot_ids)
    head.d2t = torch.zeros(DV, dtype=torch.long)  # a new tensor, as loading with assign=True makes
    assert torch.equal(head.hot_vocab.hot_ids, torch.arange(DV))


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_folded_norms_give_the_same_outputs(tmp_path, kind):
    """The norm weights a head's `fold_norms` multiplies into the projections they feed (what the engine serves):
    EAGLE-3's post-attention and final norms, EAGLE's post-attention norm. The folded norms keep only their eps;
    outputs and logits are the head's (fp32, up to its rounding)."""
    from eyas.common.layers import RMSNorm, fuse_projections

    eagle3 = kind == "eagle3"
    (write_public_eagle3 if eagle3 else write_public_eagle)(tmp_path / "head")
    head = load_draft_head(tmp_path / "head")
    if not eagle3:
        head.attach_lm_head(torch.randn(V, H, generator=torch.Generator().manual_seed(5)))
    embeds, features, pos = inputs(width=3 * HT if eagle3 else H)

    def run():
        with torch.no_grad():
            hidden = head.project_target(TargetOutput(hidden=features, aux=features))
            out = head.step(embeds, hidden, pos, CausalAttention())
            return out, head.logits(out)

    want = run()
    fuse_projections(head)
    head.fold_norms()
    head.fold_norms()  # idempotent
    got = run()
    folded = [m for m in head.modules() if isinstance(m, RMSNorm) and m.weight is None]
    assert len(folded) == (2 if eagle3 else 1)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def tiny_target(vocab=V, hidden=HT, dtype=torch.float32):
    from eyas.common.config import TargetConfig
    from eyas.common.target import TargetModel

    cfg = TargetConfig("llama", vocab, hidden, FFN, 4, HEADS, KV, hidden // HEADS, 1e-6, 256)
    return TargetModel(cfg).to(dtype)


@pytest.mark.parametrize("kind, vocab, hidden, words", [
    ("eagle3", 120, HT, f"field 'vocab_size' is {V}, but the target's vocabulary is 120"),
    ("eagle3", V, 64, f"field 'target_hidden_size' is {HT}, but the target's hidden size is 64"),
    ("eagle", 80, H, f"field 'vocab_size' is {V}, but the target's vocabulary is 80"),
])
def test_a_head_for_another_target_is_refused_naming_the_field(tmp_path, kind, vocab, hidden, words):
    """A head is checked against the target it is loaded for (a Qwen3-8B head on Llama-3.1-8B: both 4,096 wide): a
    vocabulary or stream width that differs failed inside a draft step, or drafted another tokenizer's ids."""
    (write_public_eagle3 if kind == "eagle3" else write_public_eagle)(tmp_path / "head")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'head/config.json'}: {words}"):
        load_draft_head(tmp_path / "head", tiny_target(vocab, hidden))
    assert load_draft_head(tmp_path / "head", tiny_target(V, HT if kind == "eagle3" else H)) is not None


def test_a_head_takes_its_target_s_dtype_unless_told(tmp_path):
    write_public_eagle3(tmp_path / "head")
    target = tiny_target(dtype=torch.bfloat16)
    assert load_draft_head(tmp_path / "head", target).fc.weight.dtype == torch.bfloat16
    assert load_draft_head(tmp_path / "head", target, dtype=torch.float32).fc.weight.dtype == torch.float32
    assert load_draft_head(tmp_path / "head").fc.weight.dtype == torch.float32  # no target: the checkpoint's


def test_t2d_is_derived_from_d2t_and_a_null_draft_vocab_is_the_whole(tmp_path):
    """SGLang and vLLM read d2t alone, and vLLM a draft_vocab_size of null as the target's vocabulary."""
    t = write_public_eagle3(tmp_path / "head")
    whole = load_draft_head(tmp_path / "head")
    del t["t2d"]
    save_file(t, str(tmp_path / "head/model.safetensors"))
    assert torch.equal(load_draft_head(tmp_path / "head").t2d, whole.t2d)
    t["d2t"][0] = V  # reaches past the vocabulary: refused, not masked
    save_file(t, str(tmp_path / "head/model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor 'd2t' is not a valid draft-to-target map"):
        load_draft_head(tmp_path / "head")
    write_public_eagle3(tmp_path / "null", draft_vocab_size=None)
    t = {k: v for k, v in load_file(str(tmp_path / "null/model.safetensors")).items() if k not in ("d2t", "t2d")}
    t["lm_head.weight"] = torch.zeros(V, H)
    save_file(t, str(tmp_path / "null/model.safetensors"))
    assert load_draft_head(tmp_path / "null").config.draft_vocab_size == V


def test_saving_over_a_sharded_head_leaves_only_the_new_weights(tmp_path):
    """Loaders read an index before model.safetensors: one left in the folder would shadow what was saved."""
    t = write_public_eagle3(tmp_path / "head")
    shards = {"model-00001-of-00002.safetensors": dict(list(t.items())[:3]),
              "model-00002-of-00002.safetensors": dict(list(t.items())[3:])}
    (tmp_path / "head/model.safetensors").unlink()
    for name, part in shards.items():
        save_file(part, str(tmp_path / "head" / name))
    weight_map = {k: name for name, part in shards.items() for k in part}
    (tmp_path / "head/model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "keep.safetensors").write_text("not the head's")
    head = load_draft_head(tmp_path / "head")
    with torch.no_grad():
        head.fc.weight.mul_(2)
    weight_map["x"] = "../keep.safetensors"  # a shard outside the folder is never removed
    (tmp_path / "head/model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_eagle3(head, tmp_path / "head")
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_draft_head(tmp_path / "head").fc.weight, head.fc.weight)
    assert (tmp_path / "keep.safetensors").exists()


def test_a_head_prepared_for_serving_is_not_saved(tmp_path):
    """An Engine joins a head's projections and folds its norms in place: saved so, no loader could read it."""
    from eyas.common.layers import fuse_projections

    write_public_eagle3(tmp_path / "head")
    head = load_draft_head(tmp_path / "head")
    fuse_projections(head)
    for save in (lambda: save_eagle3(head, tmp_path / "out"), lambda: export_speculators(
            head, tmp_path / "spec", verifier="org/target", verifier_architectures=["LlamaForCausalLM"])):
        with pytest.raises(ValueError, match="save a head before serving it"):
            save()
    assert not (tmp_path / "out").exists() and not (tmp_path / "spec").exists()


def test_a_corrupt_pytorch_weights_file_is_named(tmp_path):
    write_public_eagle(tmp_path / "head")
    (tmp_path / "head/model.safetensors").unlink()
    (tmp_path / "head/pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: not a readable PyTorch weights file"):
        load_draft_head(tmp_path / "head")


@pytest.mark.parametrize("fields, words", [
    ({"hidden_act": "gelu"}, "field 'hidden_act' is 'gelu'; only 'silu'"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 2, 5]}, "must be a list of distinct layer ids >= 0"),
    ({"eagle_aux_hidden_state_layer_ids": [-3, 2, 5]}, "must be a list of distinct layer ids >= 0"),
])
def test_head_config_values_no_layer_computes_are_refused(tmp_path, fields, words):
    write_public_eagle3(tmp_path / "head", **fields)
    with pytest.raises(ConfigError, match=words):
        load_draft_head(tmp_path / "head")
    write_public_eagle(tmp_path / "eagle")
    cfg = json.loads((tmp_path / "eagle/config.json").read_text())
    (tmp_path / "eagle/config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 0}))
    with pytest.raises(ConfigError, match="field 'num_hidden_layers' must be >= 1, got 0"):
        load_draft_head(tmp_path / "eagle")


def test_saved_weights_are_as_readable_as_the_config(tmp_path):
    """safetensors 0.8 writes its files for their owner alone: a head trained by one user could not be served by
    another. Saved weights take the mode the umask gives any new file, as config.json does."""
    write_public_eagle3(tmp_path / "head")
    save_eagle3(load_draft_head(tmp_path / "head"), tmp_path / "out")
    mode = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert mode["model.safetensors"] == mode["config.json"]
