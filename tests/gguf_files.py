"""Tiny GGUF files for tests: what the GGUF loading tests and a training run on a GGUF target read."""

import gguf
import numpy as np

HIDDEN, HEADS, LAYERS = 64, 4, 2
HEAD_DIM = HIDDEN // HEADS


def write_gguf(path, *, drop=(), rope_freqs=None, scaling=None, arch="llama"):
    """A two-layer Llama of random fp32 weights; `drop` leaves tensors out, `rope_freqs` [HEAD_DIM // 2] adds
    llama.cpp's per-frequency divisors, `scaling` (type, factor) its rope.scaling metadata, `arch` names another
    architecture in its metadata."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(128)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(32)])
    writer.add_token_types([1] * 32)
    writer.add_token_merges([])
    if scaling is not None:
        writer.add_string(f"{arch}.rope.scaling.type", scaling[0])
        writer.add_float32(f"{arch}.rope.scaling.factor", scaling[1])
    shapes = {"token_embd.weight": (32, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (32, HIDDEN)}
    for i in range(LAYERS):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (2 * HEAD_DIM, HIDDEN), f"blk.{i}.attn_v.weight": (2 * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (128, HIDDEN), f"blk.{i}.ffn_up.weight": (128, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, 128),
        })
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name not in drop:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
