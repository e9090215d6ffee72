"""The fused kernels (serve/kernels.py) match the torch reference (common/layers.py), and installed on a model they
replace every layer's elementwise work and its one-token projections.

Each `check_*` body runs in two places: on CUDA at the real shapes (`gpu` marker; Llama-3.1-8B: hidden 4096,
Hq 32 / Hkv 8, D 128; SmolLM2-135M: hidden 576, Hq 9 / Hkv 3, D 64; 1 to 4096 rows) and on CPU under Triton's
interpreter with small shapes, in a spawned worker (tests/triton_interpreter.py; each launch it interprets is also
compiled for Hopper as far as Triton's IR, which needs no GPU). The interpreter runs fp32 and fp16 only: triton
3.6's interpreter casts fp32 -> bf16 by truncating, not rounding to nearest, so its bf16 results are an ulp off
wherever torch rounds up; bf16 runs on CUDA.

Tolerance (atol = rtol), against the torch code in the same dtypes on the same device: 1e-5 for fp32 (fp32
reduction order, fast rsqrt and exp), 2e-3 for fp16 and 1e-2 for bf16. The kernels round wherever the reference
does, so what is left in half precision is one ulp (2^-11, 2^-8 relative) where an fp32 intermediate lands on
the other side of a rounding boundary. The one-token linear is the exception (it folds the norm out of its sum):
`check_fused_linear` says how its tolerance follows.
"""

import ast
import functools
import re

import pytest
import torch
import torch.nn.functional as F

from eyas.common.attention import CausalAttention
from eyas.common.config import RopeConfig
from eyas.common.layers import (
    Kernels,
    Rotary,
    apply_rotary,
    fuse_projections,
    fused_linear,
    norm_cat,
    rms_norm,
)
from eyas.common.target import TargetModel
from eyas.serve.fp8 import E4M3, Fp8Weight, Fp8Weights, dequantize, quantize
from tests import triton_interpreter
from tests.conftest import FAMILIES
from tests.serve.kernel_cases import DTYPES, dtype_id, randn

pytest.importorskip("triton", reason="triton is not installed (the fused kernels are optional)")
from eyas.serve import kernels  # noqa: E402  (needs triton)

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
EPS = 1e-6


def assert_matches(out, ref, dtype: torch.dtype):
    """`dtype`: the activations' (the rounding the kernels share with the reference)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def check_rms_norm(device, dtype, rows, n, sliced=False, weight_dtype=None, unit=False, impl=kernels.rms_norm):
    """x [rows, n] whose row scales span 1e-3..10 (eps matters in the smallest); `sliced`: x is a view with a row
    stride of 2n; `weight_dtype`: a weight in another dtype (the output takes the promoted one); `unit`: no weight
    (None: one folded into the next projection)."""
    scale = torch.logspace(-3, 1, rows)[:, None]
    x = randn(rows, 2 * n if sliced else n, dtype=dtype, device=device, seed=0, scale=scale)[:, :n]
    weight = None if unit else randn(n, dtype=weight_dtype or dtype, device=device, seed=2, scale=0.1) + 1
    assert_matches(impl(x, weight, EPS), rms_norm(x, weight, EPS), dtype)


def check_norm_cat(device, dtype, rows, n, strided=False, impl=kernels.norm_cat):
    """cat(norm_a(a), norm_b(b)) for a, b [rows, n] with row scales 1e-3..10 and two different norms (weights and
    eps); `strided`: b is a view with a row stride of 2n."""
    scale = torch.logspace(-3, 1, rows)[:, None]
    a = randn(rows, n, dtype=dtype, device=device, seed=0, scale=scale)
    b = randn(rows, 2 * n if strided else n, dtype=dtype, device=device, seed=1, scale=scale.flip(0))[:, :n]
    norm_a = (randn(n, dtype=dtype, device=device, seed=2, scale=0.1) + 1, EPS)
    norm_b = (randn(n, dtype=dtype, device=device, seed=3, scale=0.1) + 1, 1e-3)
    assert_matches(impl(a, b, norm_a, norm_b), norm_cat(a, b, norm_a, norm_b), dtype)


def check_fused_linear(device, dtype, rows, N, K, norm, silu, bias=False, residual=False, fp8=False,
                       impl=kernels.fused_linear):
    """residual + epilogue(linear(norm(x))) for x [rows, K] (row scales 1e-3..10 with `norm`) and weight [N, K]
    scaled to keep outputs near 1, vs the torch reference. `norm`: True, or "unit" (no weight: one folded into the
    projection); `silu`: SiLU·mul of the output's halves; `residual`: a stream [rows, N] (N / 2 with SiLU·mul) added
    to the output and left as it was, or "donated" (the caller gives it up: cuBLAS may add into it). `fp8`: the
    weight rounded to float8 (`serve/fp8.py`), the kernel reading the float8 copy; the reference the rounded weight
    in `dtype` (the same values)."""
    scale = torch.logspace(-3, 1, rows)[:, None] if norm else 4.0
    x = randn(rows, K, dtype=dtype, device=device, seed=0, scale=scale)
    weight = randn(N, K, dtype=dtype, device=device, seed=1, scale=K ** -0.5 * (4 if silu else 1))  # SiLU's tails
    stream = randn(rows, N // 2 if silu else N, dtype=dtype, device=device, seed=4) if residual else None
    stream_before = stream.clone() if residual else None
    extra = dict(
        bias=randn(N, dtype=dtype, device=device, seed=2) if bias else None,
        norm=(None if norm == "unit" else randn(K, dtype=dtype, device=device, seed=3, scale=0.1) + 1, EPS)
        if norm else None,
        silu_mul_output=silu, residual=stream, donate_residual=residual == "donated",
    )
    if fp8:
        copy = quantize(weight)
        weight = dequantize(copy, dtype)
        if rows == 1 or kernels.reads_fp8_rows(rows, N, K):  # where the kernels read the float8 copy: with
            # the copy's values zeroed, the output is a zero weight's
            zeroed = _fp8_table(weight, Fp8Weight(torch.zeros_like(copy.values), copy.scale))
            out = impl(x, weight, **_given(extra), fp8=zeroed)
            assert_linear_matches(x, torch.zeros_like(weight), out, extra, dtype)
        impl = functools.partial(impl, fp8=_fp8_table(weight, copy))
    assert_linear_matches(x, weight, impl(x, weight, **_given(extra)), extra, dtype)
    if residual is True:
        assert torch.equal(stream, stream_before), "the stream changed"


def _given(extra: dict) -> dict:
    """`extra` as a linear under test gets it: a donated residual as a copy (the kernel may write into it)."""
    return dict(extra, residual=extra["residual"].clone()) if extra["donate_residual"] else extra


def _fp8_table(weight, copy) -> Fp8Weights:
    table = Fp8Weights()
    table.add(weight, copy)
    return table


def assert_linear_matches(x, weight, out, extra, dtype):
    """`out` of a fused linear on x and weight with `extra` (its keyword arguments) against the torch reference."""
    ref = fused_linear(x, weight, **extra)
    # Absolute tolerance on the scale of the largest output: the kernel folds the norm out of the sum (the reference
    # rounds the normed input), so a projection output may land one ulp away, which SiLU·mul scales by the other
    # half. Plus fp32 rounding of the largest sum of |products| (about 240 at K = 14336, past 1e-5 in fp32): the
    # sum's order differs from cuBLAS's.
    a = rms_norm(x, *extra["norm"]) if extra["norm"] is not None else x
    bound = (a.float().abs() @ weight.float().abs().T).max().item()
    tol = TOLERANCE[dtype]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=tol * ref.float().abs().max().item() + 2**-20 * bound, rtol=tol)


def check_rotary(device, dtype, B, T, Hq, Hkv, D, strided=False, impl=kernels.rotary):
    """cos/sin from Rotary's tables at random positions; `strided`: q, k are [B, H, T, D] tensors transposed to
    [B, T, H, D] (head stride D, token stride H * D), cos and sin one [1, T, D] row broadcast over B."""
    q, k = (randn(B, H, T, D, dtype=dtype, device=device, seed=s).transpose(1, 2) if strided else
            randn(B, T, H, D, dtype=dtype, device=device, seed=s) for s, H in ((0, Hq), (1, Hkv)))
    positions = torch.randint(0, 100_000, (1 if strided else B, T), generator=torch.Generator().manual_seed(2))
    rotary = Rotary(RopeConfig(theta=500000.0), D).to(device)
    cos, sin = rotary(positions.to(device), dtype)
    q_out, k_out = impl(q, k, cos, sin)
    assert_matches(q_out, apply_rotary(q, cos, sin), dtype)
    assert_matches(k_out, apply_rotary(k, cos, sin), dtype)


def check_rotary_store(device, dtype, B, T, Hq, Hkv, D, impl=kernels.rotary_store):
    """q, k, v: views of one joint [B, T, (Hq + 2 Hkv) D] projection output, as served; rotated q returned, rotated k
    and v written to random cache rows (the rest of the caches untouched, v copied exactly)."""
    qkv = randn(B, T, (Hq + 2 * Hkv) * D, dtype=dtype, device=device, seed=0)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(B, T, Hq, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
    positions = torch.randint(0, 100_000, (B, T), generator=torch.Generator().manual_seed(2))
    cos, sin = Rotary(RopeConfig(theta=500000.0), D).to(device)(positions.to(device), dtype)
    slots = torch.randperm(3 * B * T, generator=torch.Generator().manual_seed(3))[: B * T].view(B, T).to(device)
    k_cache, v_cache = (randn(3 * B * T, Hkv, D, dtype=dtype, device=device, seed=s) for s in (4, 5))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q_out = impl(q, k, v, cos, sin, slots, k_cache, v_cache)
    assert_matches(q_out, apply_rotary(q, cos, sin), dtype)
    assert_matches(k_cache[slots], apply_rotary(k, cos, sin), dtype)
    assert torch.equal(v_cache[slots], v)
    others = torch.ones(k_cache.shape[0], dtype=torch.bool, device=device)
    others[slots.flatten()] = False
    assert torch.equal(k_cache[others], k_before[others]) and torch.equal(v_cache[others], v_before[others])


def check_silu_mul(device, dtype, shape, impl=kernels.silu_mul, joint=False):
    """joint: gate and up are the halves of one [..., 2N] tensor (a joint gate/up projection's output), rows strided."""
    gate = randn(*shape, dtype=dtype, device=device, seed=0, scale=4.0)  # well into both tails of SiLU
    up = randn(*shape, dtype=dtype, device=device, seed=1)
    if joint:
        gate, up = torch.cat([gate, up], dim=-1).chunk(2, dim=-1)
    assert_matches(impl(gate, up), F.silu(gate) * up, dtype)


def check_model(path, device, dtype, rel_tol, B, T, joint=False):
    """The whole TargetModel forward on B rows of T tokens (final hidden, aux states, logits) with the fused kernels
    installed vs the torch ones, each fused kernel called where expected. `joint`: q/k/v and gate/up projections
    joined, as served (the norms and SiLU·mul then run inside `linear`)."""
    model = TargetModel.from_pretrained(path, dtype=dtype, device=device)
    if joint:
        fuse_projections(model)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(T, device=device).expand(B, -1) + 7

    def forward():
        out = model(ids, positions, CausalAttention(), aux_layers=cfg.default_aux_layers)
        return out.hidden, out.aux, model.logits(out.hidden)

    calls = {name: 0 for name in ("rms_norm", "rotary", "silu_mul", "linear")}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return getattr(kernels.FUSED, name)(*args, **kwargs)
        return call

    with torch.no_grad():
        ref = forward()
        kernels.install(model, Kernels(**{name: counted(name) for name in calls}))
        out = forward()
    L, qk_norms = cfg.num_hidden_layers, 2 if cfg.qk_norm else 0
    # Per layer, joint: Qwen3's q and k norms, four linears (the other norms, the residual adds and SiLU·mul inside
    # them). Separate: the two norms, SiLU·mul, the o and down linears (the residual adds inside them). And the final
    # norm.
    expected = dict(rms_norm=qk_norms * L + 1, rotary=L, silu_mul=0, linear=4 * L) if joint else dict(
        rms_norm=(qk_norms + 2) * L + 1, rotary=L, silu_mul=L, linear=2 * L)
    assert calls == expected
    for a, b in zip(out, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < rel_tol, f"relative error {rel:.2e}"
    kernels.install(model, Kernels())  # back to the torch reference
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(forward(), ref, strict=True))


# --- CUDA: the real shapes ---
@pytest.mark.gpu
@pytest.mark.parametrize("rows, n", [(1, 4096), (7, 4096), (4096, 4096), (1, 576), (4096, 576), (4096 * 8, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rms_norm_cuda(dtype, rows, n):
    check_rms_norm("cuda", dtype, rows, n)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rms_norm_cuda_strided_mixed_dtypes_and_unit(dtype):
    check_rms_norm("cuda", dtype, 300, 4096, True)
    check_rms_norm("cuda", dtype, 300, 576, False, torch.float32)
    check_rms_norm("cuda", dtype, 1, 4096, False, None, True)
    check_rms_norm("cuda", dtype, 300, 576, True, None, True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, n, strided", [(1, 576, False), (8, 4096, True), (64, 576, True), (300, 4096, False)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_norm_cat_cuda(dtype, rows, n, strided):
    check_norm_cat("cuda", dtype, rows, n, strided)


# Llama-3.1-8B's four projections and lm_head, SmolLM2's q/k/v and gate/up; one row (the Triton kernel), 8 (a tree's
# verification: the four projections as long calls of `rows_kernel`, the lm_head on cuBLAS), and 17 to 64 (the 8B
# projections as whole-SM calls of `rows_kernel` in a 32- or 64-row tile; SmolLM2's weights as small ones).
# The residual stream is added by o and down ("donated": cuBLAS adds in place); the norms before q/k/v and gate/up
# are whole or folded ("unit").
LINEAR_CUDA = [(1, 6144, 4096, "unit", False, False, False), (1, 4096, 4096, False, False, False, True),
               (1, 28672, 4096, "unit", True, False, False), (1, 4096, 14336, False, False, False, "donated"),
               (1, 128256, 4096, True, False, False, False), (1, 960, 576, True, False, True, False),
               (1, 3072, 576, True, True, True, False), (48, 6144, 4096, "unit", False, False, False),
               (48, 28672, 4096, "unit", True, False, False), (48, 4096, 4096, False, False, True, True),
               (48, 4096, 14336, False, False, False, "donated"), (8, 4096, 4096, False, False, False, True),
               (8, 28672, 4096, "unit", True, False, False), (8, 28672, 4096, True, True, False, False),
               (8, 4096, 14336, False, False, False, "donated"), (8, 6144, 4096, "unit", False, False, False),
               (2, 960, 576, True, False, True, False), (8, 3072, 576, "unit", True, False, False),
               (17, 576, 1536, False, False, True, True), (8, 576, 1536, False, False, False, "donated"),
               (64, 960, 576, "unit", False, False, False), (8, 3072, 576, False, True, True, False),
               (33, 28672, 4096, "unit", True, False, False), (64, 4096, 14336, False, False, False, True),
               (32, 6144, 4096, "unit", False, False, False), (17, 4096, 14336, False, False, False, "donated"),
               (24, 28672, 4096, "unit", True, False, False)]
# rows, N, K, norm, silu, bias, residual; past one row, `rows_operands` routes them
# Float8 copies (`--draft-fp8`) at a Llama-3.1-8B EAGLE-3 head's shapes: q/k/v on the 2H input, gate/up, down, the
# 32,000-row lm_head with the final norm, fc, o; one row (a chain's pass), 4 to 8 (a tree's, K split over 2 or 4
# programs but for the lm_head), 48 (the rounded weight in a whole-SM call); and SmolLM2's (past one row, its rounded
# weight).
# The last two with the head's norms folded, as served.
LINEAR_FP8_CUDA = [(1, 6144, 8192, False, False, False, False), (1, 28672, 4096, True, True, False, False),
                   (1, 32000, 4096, True, False, False, False), (4, 6144, 8192, False, False, False, False),
                   (4, 28672, 4096, True, True, False, False), (4, 4096, 14336, False, False, False, "donated"),
                   (8, 32000, 4096, True, False, False, False), (6, 4096, 12288, False, False, False, False),
                   (48, 28672, 4096, True, True, False, False), (4, 3072, 576, True, True, True, False),
                   (8, 4096, 4096, False, False, True, True), (8, 28672, 4096, "unit", True, False, False),
                   (4, 32000, 4096, "unit", False, False, False)]


def _linear_id(case):
    rows, N, K, norm, silu, bias, residual = case
    return (f"r{rows}-N{N}-K{K}" + {False: "", True: "-norm", "unit": "-unitnorm"}[norm] + "-silu" * silu
            + "-bias" * bias + {False: "", True: "-res", "donated": "-donated"}[residual])


@pytest.mark.gpu
@pytest.mark.parametrize("case", LINEAR_CUDA, ids=_linear_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fused_linear_cuda(dtype, case):
    check_fused_linear("cuda", dtype, *case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", LINEAR_FP8_CUDA, ids=_linear_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_fused_linear_fp8_cuda(dtype, case):
    check_fused_linear("cuda", dtype, *case, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("B, T", [(1, 1), (64, 1), (1, 4096), (4, 300)])
@pytest.mark.parametrize("Hq, Hkv, D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rotary_cuda(dtype, Hq, Hkv, D, B, T, strided):
    check_rotary("cuda", dtype, B, T, Hq, Hkv, D, strided)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T", [(1, 1), (64, 1), (1, 48), (4, 300)])
@pytest.mark.parametrize("Hq, Hkv, D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rotary_store_cuda(dtype, Hq, Hkv, D, B, T):
    check_rotary_store("cuda", dtype, B, T, Hq, Hkv, D)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 14336), (4, 300, 14336), (64, 1, 1536), (1, 4096, 1536)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("joint", [False, True], ids=["separate", "joint"])
def test_silu_mul_cuda(dtype, shape, joint):
    check_silu_mul("cuda", dtype, shape, joint=joint)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, joint", [(2, 300, False), (2, 300, True), (1, 1, True)], ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_cuda(family, B, T, joint, hf_checkpoint):
    check_model(hf_checkpoint(family)[0], "cuda", torch.bfloat16, 2e-2, B, T, joint)


@pytest.mark.gpu
def test_model_cuda_graph(hf_checkpoint):
    """The fused forward captures in a CUDA graph (no host syncs) and replays on new inputs."""
    model = TargetModel.from_pretrained(hf_checkpoint("qwen3")[0], dtype=torch.bfloat16, device="cuda")
    kernels.install(model)
    ids = torch.randint(0, model.config.vocab_size, (4, 5), device="cuda")
    positions = torch.arange(5, device="cuda").expand(4, -1).contiguous()
    forward = lambda: model(ids, positions, CausalAttention()).hidden
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()  # compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()
        for seed in (1, 2):
            ids.copy_(torch.randint(0, model.config.vocab_size, (4, 5), generator=torch.Generator().manual_seed(seed)))
            positions.add_(11)
            graph.replay()
            torch.testing.assert_close(out, forward(), atol=1e-2, rtol=1e-2)  # a stale replay would be far off


# --- CPU: Triton's interpreter, small shapes ---
HALVES = [torch.float32, torch.float16]
RMS_CPU = [(1, 576, False, None, False), (7, 96, False, None, True), (33, 128, True, None, True),
           (5, 64, True, torch.float32, False)]  # rows, n, sliced, weight_dtype, unit


@pytest.mark.parametrize("case", RMS_CPU,
                         ids=lambda c: f"r{c[0]}-n{c[1]}{'-sliced' * c[2]}{'-w32' * (c[3] is not None)}"
                         f"{'-unit' * c[4]}")
@pytest.mark.parametrize("dtype", HALVES, ids=dtype_id)
def test_rms_norm_interpreter(interpreter, dtype, case):
    interpreter(check_rms_norm, "cpu", dtype, *case)


@pytest.mark.parametrize("rows, n, strided", [(1, 96, False), (9, 100, True)], ids=str)
@pytest.mark.parametrize("dtype", HALVES, ids=dtype_id)
def test_norm_cat_interpreter(interpreter, dtype, rows, n, strided):
    interpreter(check_norm_cat, "cpu", dtype, rows, n, strided)


LINEAR_CPU = [(1, 40, 300, True, False, True, False), (1, 66, 1100, False, True, True, False),
              (1, 600, 64, "unit", True, False, False), (1, 33, 2100, False, False, False, True),
              (1, 8, 2500, True, False, False, "donated"), (3, 40, 96, False, False, False, True),
              (20, 70, 300, False, True, True, False), (24, 40, 200, "unit", True, False, True),
              (4, 40, 1100, False, False, True, True),
              (5, 64, 1300, "unit", True, False, False), (6, 50, 200, False, False, False, "donated"),
              (3, 40, 96, "unit", False, True, False), (1, 24, 4100, True, False, True, True),
              (1, 12, 4096, False, True, False, False), (4, 40, 300, True, True, False, False)]
# rows, N, K, norm, silu, bias, residual; ragged N and K; past one row, `rows_matmul` (fp16: a folded norm's 1 / RMS
# in the kernel, its squares by x xᵀ in a tile of 16 rows, elementwise in one of 64, or normalised first where K is
# split, as a whole norm always is) or torch's matmul (fp32: a folded norm's 1 / RMS then in SiLU·mul, a donated
# stream added in place), two with K split over 3 and 4 programs; then one row of a long K in 4 (2 with SiLU·mul)
# weight rows a program, twice; last, a whole norm before the few-rows kernel


@pytest.mark.parametrize("case", LINEAR_CPU, ids=_linear_id)
@pytest.mark.parametrize("dtype", HALVES, ids=dtype_id)
def test_fused_linear_interpreter(interpreter, dtype, case):
    interpreter(check_fused_linear, "cpu", dtype, *case)


LINEAR_FP8_CPU = [(1, 40, 300, True, False, True, True), (1, 66, 1100, False, True, True, False),
                  (3, 40, 96, True, False, False, True), (3, 512, 32768, False, False, True, "donated"),
                  (2, 256, 65536, False, True, False, False), (2, 16384, 1024, "unit", False, False, False),
                  (1, 24, 4100, True, True, False, True), (1, 40, 4096, "unit", False, True, "donated")]
# past one row: a small weight (the rounded weight read); 2^24 entries (the copy read, K over 4 programs, or unsplit
# over 512 tiles with a folded norm, as an 8B head's lm_head); then one row of a long K, in float8's longer chunks


@pytest.mark.parametrize("case", LINEAR_FP8_CPU, ids=_linear_id)
def test_fused_linear_fp8_interpreter(interpreter, case):
    """The float8 copies under the interpreter, in fp16 (past one row fp32 goes to torch, with the rounded weight)."""
    interpreter(check_fused_linear, "cpu", torch.float16, *case, True)


def check_row_squares(device, dtype, rows, N, K, consumers, fp8=True, producer_launch=None, consumer_launch=None):
    """The stream r = res + x wᵀ [rows, N] of a few-rows call adding it (an o or a down: `rows_kernel` with a
    residual) holds its rows' squares (`RowSquares`), and each consumer (a weight [n, N] after a folded norm; (n,
    SiLU·mul)) then scales its sums by 1 / RMS from them, as the reference normalises r first: it launches no
    `rms_norm` (float8 copies did) and sums no squares of its own (squares scaled by 4 halve its output); once r
    changes in place, the consumer normalises it itself again; a stream made under `torch.inference_mode` keeps none.
    `fp8`: the weights rounded to float8 and the kernels reading the copies. Launches: the served ones, or those
    given (K split: the squares written by a tile's last program, each split's sums scaled)."""
    def weight_and_copy(n, k, seed, scale):
        weight = randn(n, k, dtype=dtype, device=device, seed=seed, scale=scale)
        copy = quantize(weight) if fp8 else None
        return (dequantize(copy, dtype), copy) if fp8 else (weight, None)

    x = randn(rows, K, dtype=dtype, device=device, seed=0, scale=torch.logspace(-3, 1, rows)[:, None])
    stream = randn(rows, N, dtype=dtype, device=device, seed=1)
    producer = weight_and_copy(N, K, 2, K ** -0.5)
    r = kernels.rows_kernel(x, producer[0], None, False, producer[1], producer_launch, residual=stream)
    assert kernels.has_row_squares(r)
    torch.testing.assert_close(r.row_squares.sums.sum(1), r.float().square().sum(1), rtol=1e-5, atol=0)
    weights = [(*weight_and_copy(n, N, seed, N ** -0.5 * (4 if silu else 1)), silu)
               for seed, (n, silu) in enumerate(consumers, 3)]

    def consume(weight, copy, silu):
        out = kernels.rows_kernel(r, weight, None, silu, copy, consumer_launch, norm=(None, EPS))
        extra = dict(bias=None, norm=(None, EPS), silu_mul_output=silu, residual=None, donate_residual=False)
        assert_linear_matches(r, weight, out, extra, dtype)
        return out

    rms_norm_launch = kernels.rms_norm
    kernels.rms_norm = None  # a consumer that normalises r in a launch of its own fails
    try:
        outs = [consume(*consumer) for consumer in weights]
        plain = [silu for *_, silu in weights].index(False)  # a consumer without SiLU·mul: linear in 1 / RMS
        weight, copy, _ = weights[plain]
        r.row_squares.sums.mul_(4)
        halved = kernels.rows_kernel(r, weight, None, False, copy, consumer_launch, norm=(None, EPS))
        torch.testing.assert_close(halved.float(), outs[plain].float() / 2, rtol=TOLERANCE[dtype], atol=1e-6)
    finally:
        kernels.rms_norm = rms_norm_launch
    r.mul_(1.5)  # changed in place: its squares are stale
    assert not kernels.has_row_squares(r)
    for consumer in weights:
        consume(*consumer)
    with torch.inference_mode():  # no versions to tell a stale stream by: none kept
        assert not kernels.has_row_squares(kernels.rows_kernel(x, producer[0], None, False, producer[1],
                                                               producer_launch, residual=stream))


# rows, N, K, consumers (n, SiLU·mul), float8, launches of the producer and the consumers: ragged N (a tile's columns
# past N add no squares); K split over 3 programs in the producer, the consumers or both; fp16 weights, in tiles of 16
# and of 64 rows
ROW_SQUARES_CPU = [(5, 96, 80, [(96, True), (130, False)]),
                   (3, 96, 80, [(130, False)], True, *[kernels.RowsLaunch(64, 32, 2, 4, 3)] * 2),
                   (16, 200, 64, [(2 * 72, True), (100, False)], True, None, kernels.RowsLaunch(64, 64, 2, 4, 3)),
                   (5, 100, 80, [(96, True), (130, False)], False),
                   (40, 100, 80, [(2 * 72, True), (130, False)], False)]


@pytest.mark.parametrize("case", ROW_SQUARES_CPU, ids=["fp8", "fp8-split", "fp8-split-consumer", "rows-5", "rows-40"])
def test_row_squares_interpreter(interpreter, case):
    interpreter(check_row_squares, "cpu", torch.float16, *case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_row_squares_cuda(dtype):
    """At the served launches: an 8B EAGLE-3 head's float8 o and down feeding its gate/up and 8,192-row lm_head at 4
    and 8 rows (a draft pass); an 8B target's o and down feeding its gate/up and q/k/v at 8 and 48 rows (whole-SM
    calls, verification), SmolLM2's at 64."""
    for rows in (4, 8):
        check_row_squares("cuda", dtype, rows, 4096, 4096, [(28672, True), (8192, False)])
        check_row_squares("cuda", dtype, rows, 4096, 14336, [(8192, False)])
    for rows in (8, 48):
        check_row_squares("cuda", dtype, rows, 4096, 4096, [(28672, True), (6144, False)], False)
        check_row_squares("cuda", dtype, rows, 4096, 14336, [(6144, False)], False)
    check_row_squares("cuda", dtype, 64, 576, 576, [(3072, True), (960, False)], False)
    check_row_squares("cuda", dtype, 64, 576, 1536, [(960, False)], False)


def run_e4m3_ptx(ptx: str, word: int) -> tuple[int, int]:
    """`kernels._e4m3_ptx`'s instructions (prmt, shl and and on 32-bit registers, as PTX defines them) run on one
    input word $2 -> ($0, $1)."""
    registers = {"$2": word}
    for instruction in filter(None, (part.strip() for part in ptx.split(";"))):
        op, operands = instruction.split(None, 1)
        destination, *sources = (o.strip() for o in operands.split(","))
        a, *rest = (registers[o] if o.startswith("$") else int(o, 0) for o in sources)
        if op == "prmt.b32":  # each result byte: a byte of {rest[0], a} by a selector nibble, or (bit 3) its sign
            pool = (a | rest[0] << 32).to_bytes(8, "little")
            result = 0
            for i in range(4):
                nibble = rest[1] >> 4 * i & 0xF
                byte = pool[nibble & 7]
                result |= (0xFF * (byte >> 7) if nibble & 8 else byte) << 8 * i
        elif op == "shl.b32":
            result = a << rest[0] & 0xFFFFFFFF
        else:
            assert op == "and.b32", op
            result = a & rest[0]
        registers[destination] = result
    return registers["$0"], registers["$1"]


@pytest.mark.parametrize("ptx, dtype, factor", [(kernels.E4M3_TO_BF16, torch.bfloat16, 2.0**-120),
                                                 (kernels.E4M3_TO_FP16, torch.float16, 2.0**-8)], ids=["bf16", "fp16"])
def test_float8_ptx_makes_each_value_times_its_factor(ptx, dtype, factor):
    """The compiled kernels' float8 conversion (which the CPU cannot run) gives every e4m3 value but NaN (which
    `quantize` never makes) times the factor `_e4m3_unscale` takes back, exactly, in each of a word's four bytes."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    expected = (codes.view(torch.float8_e4m3fn).float() * factor).to(dtype).view(torch.int16).int() & 0xFFFF
    neighbours = torch.randint(0, 256, (len(codes), 4), generator=torch.Generator().manual_seed(0))
    for position in range(4):
        bytes_ = neighbours.clone()
        bytes_[:, position] = codes.int()
        for row, want in zip(bytes_.tolist(), expected.tolist(), strict=True):
            low, high = run_e4m3_ptx(ptx.value, int.from_bytes(bytes(row), "little"))
            lanes = [low & 0xFFFF, low >> 16, high & 0xFFFF, high >> 16]
            assert lanes[position] == want, f"byte {row[position]:#04x} at {position}: {lanes[position]:#06x}"


def check_rows_kernel_launches(device, dtype):
    """`rows_kernel` at launches other than the served one (the linear benchmark's grid), with and without SiLU·mul,
    K split into more runs than it has chunks included: each gives the reference's output."""
    x = randn(5, 300, dtype=dtype, device=device, seed=0)
    weight = randn(80, 300, dtype=dtype, device=device, seed=1, scale=300 ** -0.5 * 4)
    for silu in (False, True):
        extra = dict(bias=None, residual=None, donate_residual=False, norm=None, silu_mul_output=silu)
        for launch in (kernels.RowsLaunch(16, 64, 2, 4, 1), kernels.RowsLaunch(32, 128, 3, 4, 3),
                       kernels.RowsLaunch(16, 32, 2, 4, 7), kernels.RowsLaunch(64, 128, 2, 4, 9)):
            out = kernels.rows_kernel(x, weight, silu_mul_output=silu, launch=launch)
            assert_linear_matches(x, weight, out, extra, dtype)


def test_rows_kernel_launches_interpreter(interpreter):
    interpreter(check_rows_kernel_launches, "cpu", torch.float16)


def test_rows_kernel_runs_the_launch_it_is_given(monkeypatch):
    """The launch reaches the kernel: its grid (tiles, splits as equal runs of whole chunks) and its constants; with
    none given, the served one (`rows_launch`)."""
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **options: launched.append((grid, options))

    monkeypatch.setattr(kernels, "_rows_matmul_kernel", Recorder())
    x, weight = torch.zeros(5, 300, dtype=torch.float16), torch.zeros(80, 300, dtype=torch.float16)
    kernels.rows_kernel(x, weight, silu_mul_output=True, launch=kernels.RowsLaunch(16, 32, 3, 8, 7))
    kernels.rows_kernel(x, weight)
    kernels.rows_kernel(torch.zeros(20, 300, dtype=torch.float16), weight)
    (grid, options), (served_grid, served_options), (_, options_20) = launched
    assert grid == (3, 5)  # 40 outputs over 16 a program; 10 chunks of 32 in 5 runs of 2 (7 would leave 1 empty)
    assert (options["BLOCK_N"], options["BLOCK_K"], options["num_stages"], options["num_warps"]) == (16, 32, 3, 8)
    assert options["SPLITS"] == 5 and options["SILU_MUL"]
    served = kernels.rows_launch(5, 80, 300, False, False)
    assert served_grid == (-(-80 // served.block_n), served.splits)
    assert (served_options["BLOCK_N"], served_options["BLOCK_K"], served_options["num_stages"],
            served_options["num_warps"]) == served[:4]
    assert served_options["BLOCK_M"] == 16 and options_20["BLOCK_M"] == 64  # `rows_tile`
    # a small weight's 64-row tile: the norm's squares elementwise, every chunk in the loop (`early_first_chunk`)
    assert served_options["SQUARES_BY_DOT"] and served_options["EARLY_CHUNK"]
    assert not options_20["SQUARES_BY_DOT"] and not options_20["EARLY_CHUNK"] and options_20["PREFETCH"]


def test_rows_operands_take_large_weights_only_in_long_calls():
    """bf16 weights of up to ROWS_MAX_WEIGHT entries go to the few-rows kernel at 2 to ROWS_MAX rows, larger ones of up
    to ROWS_LONG_MAX_WEIGHT only as long or whole-SM calls (`long_call`, `whole_sm_call`: an 8B target's q/k/v, down
    and gate/up, bounded by one half's entries through SiLU·mul, at verification; not SmolLM2's lm_head, nor a
    32,000-row lm_head of the gate/up's entries); float8 copies of large weights are read up to ROWS_FEW rows; the
    rest goes to cuBLAS."""
    def takes(rows, N, K, fp8=False, silu=False):
        weight = torch.empty(N, K, dtype=torch.bfloat16, device="meta")
        copy = Fp8Weight(torch.empty(N, K, dtype=E4M3, device="meta"), torch.empty(N, device="meta")) if fp8 else None
        x = torch.empty(rows, K, dtype=torch.bfloat16, device="meta")
        taken, read = kernels.rows_operands(x, weight, copy, silu)
        assert read is (copy if taken and fp8 else None)
        return taken

    assert takes(8, 6144, 4096) and takes(2, 4096, 14336) and takes(16, 4096, 14336)
    assert takes(17, 4096, 14336) and takes(32, 6144, 4096) and takes(64, 4096, 4096)
    assert takes(33, 4096, 14336) and takes(48, 6144, 4096) and takes(64, 6144, 4096) and not takes(65, 6144, 4096)
    assert not takes(1, 4096, 4096) and not takes(65, 4096, 4096)
    assert takes(8, 28672, 4096, silu=True) and not takes(8, 28672, 4096) and not takes(8, 32000, 4096)
    assert takes(17, 28672, 4096, silu=True) and not takes(8, 57344, 4096, silu=True)
    assert takes(48, 28672, 4096, silu=True) and not takes(48, 32000, 4096) and not takes(48, 16384, 2048)
    assert not takes(8, 49152, 576) and takes(8, 49152, 576, fp8=True)
    assert takes(16, 28672, 4096, fp8=True) and not takes(17, 28672, 4096, fp8=True)


def test_rows_kernel_launches_long_calls_that_share_sms_after_the_kernel_before(monkeypatch):
    """Under programmatic dependent launch a long call that shares SMs (`long_call` on a float8 copy: few rows of a
    large weight over a long K) launches without it (the 8B step is faster so), a call on bf16 weights that holds
    whole SMs (`whole_sm_call`: at 16 rows, and at 48), and any other with it: a smaller weight, a shorter K. Within
    `releasing_late` every one but the whole-SM calls launches under it and lets the next launch only at its end."""
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **options: launched.append(options)

    def launch_all():
        launched.clear()
        for rows, N, K, float8 in [(16, 4096, 4096, True), (16, 4096, 4096, False), (48, 4096, 4096, False),
                                   (16, 4095, 4096, False), (16, 32768, 512, False)]:
            copy = Fp8Weight(torch.empty(N, K, dtype=E4M3, device="meta"), torch.empty(N, device="meta"))
            kernels.rows_kernel(torch.empty(rows, K, dtype=torch.bfloat16, device="meta"),
                                torch.empty(N, K, dtype=torch.bfloat16, device="meta"),
                                quantized=copy if float8 else None)
        return launched

    monkeypatch.setattr(kernels, "_rows_matmul_kernel", Recorder())
    monkeypatch.setattr(kernels, "_launches_dependents", lambda device: True)
    shared, whole, whole_48, *others = launch_all()
    assert shared["PDL"] == 0 and "launch_pdl" not in shared
    assert all(options["PDL"] == kernels.EARLY.value and options["launch_pdl"]
               for options in [whole, whole_48, *others])
    with kernels.releasing_late():
        shared, whole, whole_48, *others = launch_all()
        assert all(options["PDL"] == kernels.LATE.value and options["launch_pdl"] for options in [shared, *others])
        assert all(options["PDL"] == kernels.EARLY.value and options["launch_pdl"] for options in [whole, whole_48])
    assert launch_all()[0]["PDL"] == 0  # as before, outside


def test_whole_sm_launches_take_tiles_of_32_columns_where_those_fit_one_wave():
    """A bf16 long call's program fills an SM (`whole_sm_call`): 32 output columns a program where the tiles fit the
    GPU's SMs at once (an 8B target's o and down: 128 tiles on 132 SMs), else 64 (its q/k/v: 192 tiles of 32);
    through SiLU·mul always 64 of each half; past 16 rows, as WHOLE_SM_LAUNCHES gives for the rows' tile. Where a
    program may not ask WHOLE_SM_SHARED (an A100's 163 KB, sm_86/sm_89's 99 KB) the launches share SMs as before;
    float8 copies' launches do not depend on the GPU."""
    def launch(N_out, on, silu=False, float8=False, rows=8):
        return kernels.rows_launch(rows, N_out, 4096, float8, silu, on)

    hopper, fewer, small = kernels.HOPPER, kernels.Gpu(100, kernels.HOPPER.shared), kernels.Gpu(132, 99 << 10)
    assert launch(4096, hopper) == (32, 256, 6, 4, 1) and launch(32 * 132, hopper).block_n == 32
    assert launch(32 * 132 + 1, hopper).block_n == 64 and launch(6144, hopper) == (64, 256, 4, 4, 1)
    assert launch(4096, fewer).block_n == 64
    assert launch(14336, hopper, silu=True) == (64, 128, 5, 4, 1) and launch(4096, hopper, silu=True).block_n == 64
    assert launch(4096, small) == (32, 256, 4, 4, 1) and launch(14336, small, silu=True) == (64, 64, 4, 4, 1)
    assert launch(4096, hopper, float8=True) == launch(4096, small, float8=True)
    assert [kernels.whole_sm_call(8, 4096, 4096, False, on) for on in (hopper, small)] == [True, False]
    assert launch(4096, hopper, rows=48) == (32, 128, 6, 4, 1) and launch(6144, hopper, rows=33) == (64, 64, 9, 4, 1)
    assert launch(14336, hopper, silu=True, rows=64) == (64, 128, 3, 4, 1)
    assert launch(4096, hopper, rows=17) == (32, 256, 5, 4, 1) and launch(6144, hopper, rows=32) == (64, 256, 4, 4, 1)
    assert launch(14336, hopper, silu=True, rows=32) == (64, 128, 4, 4, 1)
    assert launch(4096, small, rows=48) == launch(4096, small, rows=32) == (32, 128, 4, 4, 1)
    assert [kernels.whole_sm_call(rows, 4096, 4096, False) for rows in (16, 17, 64, 65)] == [True] * 3 + [False]


def test_rows_kernel_fits_its_launch_to_the_device_and_times_a_given_one_as_sharing_sms(monkeypatch):
    """`rows_kernel` reads its device's SMs and shared memory (`gpu`): an 8B target's o at 8 rows takes 64 columns a
    program on 100 SMs, and shares SMs (no PDL outside `releasing_late`) where a program may ask 99 KB. A launch
    given (the linear benchmark's grid), even the served one, runs as a long call that shares SMs (up to ROWS_FEW
    rows; past them as a short call)."""
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **options: launched.append(options)

    monkeypatch.setattr(kernels, "_rows_matmul_kernel", Recorder())
    monkeypatch.setattr(kernels, "_launches_dependents", lambda device: True)
    x, weight = (torch.empty(*shape, dtype=torch.bfloat16, device="meta") for shape in ((8, 4096), (4096, 4096)))
    for on in (kernels.Gpu(100, kernels.HOPPER.shared), kernels.Gpu(132, 99 << 10)):
        monkeypatch.setattr(kernels, "gpu", lambda device, on=on: on)
        kernels.rows_kernel(x, weight)
    fewer, small = launched
    assert fewer["BLOCK_N"] == 64 and fewer["PDL"] == kernels.EARLY.value
    assert small["BLOCK_N"] == 32 and small["num_stages"] == 4 and small["PDL"] == 0
    monkeypatch.setattr(kernels, "gpu", lambda device: kernels.HOPPER)
    kernels.rows_kernel(x, weight, launch=kernels.RowsLaunch(32, 128, 4, 4, 1))
    kernels.rows_kernel(x, weight, launch=kernels.rows_launch(8, 4096, 4096, False, False))
    kernels.rows_kernel(x, weight)
    rows_48 = torch.empty(48, 4096, dtype=torch.bfloat16, device="meta")
    with kernels.releasing_late():
        kernels.rows_kernel(rows_48, weight, launch=kernels.rows_launch(48, 4096, 4096, False, False))
        kernels.rows_kernel(rows_48, weight)
    *_, other, given_served, served, given_48, served_48 = launched
    assert other["PDL"] == given_served["PDL"] == 0 and served["PDL"] == kernels.EARLY.value
    assert given_48["PDL"] == kernels.LATE.value and served_48["PDL"] == kernels.EARLY.value
    assert given_served["BLOCK_N"] == served["BLOCK_N"] and given_served["num_stages"] == served["num_stages"]


def test_small_weights_past_few_rows_take_narrow_tiles_deeply_pipelined():
    """A small weight's verification call waits on its loads' latency (`rows_launch`): past ROWS_FEW rows SmolLM2's
    weights take 16 columns a program in chunks of 64 with 6 stages, its down (36 such tiles over 24 chunks) split
    three ways, in tiles of 64 rows; at a draft pass's 8 rows, and for large weights, the launches are as before."""
    smollm2 = [(960, 576, False), (576, 576, False), (1536, 576, True), (576, 1536, False)]  # q/k/v, o, gate/up, down
    for rows in (17, 48, 64):
        launches = [kernels.rows_launch(rows, N_out, K, False, silu) for N_out, K, silu in smollm2]
        assert {launch[:4] for launch in launches} == {(16, 64, 6, 4)}
        assert [launch.splits for launch in launches] == [1, 1, 1, 3]
    assert kernels.rows_launch(16, 960, 576, False, False) == (32, 128, 4, 4, 1)
    assert kernels.rows_launch(8, 576, 1536, False, False) == (32, 128, 4, 4, 6)
    assert kernels.rows_launch(48, 4096, 4096, False, False, kernels.Gpu(132, 99 << 10)) == (32, 128, 4, 4, 1)
    # and run in tiles of 64 rows from 17 rows (`rows_tile`), where large weights and 16 rows or fewer keep the
    # next power of two
    assert [kernels.rows_tile(rows, 1536 * 2, 576) for rows in (1, 8, 16, 17, 32, 48)] == [16, 16, 16, 64, 64, 64]
    assert [kernels.rows_tile(rows, 4096, 4096) for rows in (17, 24, 48)] == [32, 32, 64]


def test_short_calls_of_small_weights_ask_l2_for_all_their_weights():
    """Before its wait a program asks L2 for its whole run of K of a small bf16/fp16 weight (a power of two at least
    that run); large weights, float8 copies, and so the long and whole-SM calls, ask for none: as launched, too."""
    from eyas.serve import hopper_compile, linear_bench

    assert kernels.l2_prefetch(960, 576, 1, 64, False) == 1024
    assert kernels.l2_prefetch(576, 1536, 3, 64, False) == 512  # 8 of its 24 chunks of 64
    assert kernels.l2_prefetch(40, 100, 1, 32, False) == 128
    assert kernels.l2_prefetch(4096, 4096, 1, 128, False) == 0
    assert kernels.l2_prefetch(960, 576, 1, 64, True) == 0

    def launched(N, K, rows):  # rows_kernel's PREFETCH, its launch recorded on meta tensors
        x, weight, _ = linear_bench.meta_operands(N, K, rows, False)
        (launch,) = hopper_compile.recorded_launches(lambda: kernels.rows_kernel(x, weight))
        return dict(launch.constexprs)["PREFETCH"]

    assert kernels.whole_sm_call(48, 4096, 4096, False) and kernels.long_call(8, 6144, 4096)
    assert [launched(960, 576, 64), launched(4096, 4096, 48), launched(6144, 4096, 8)] == [1024, 0, 0]


def test_rows_splits_fit_the_counters_and_leave_no_run_empty():
    """Every split tile has an arrival counter, and each of a tile's programs sums at least one chunk of K: the K
    runs are equal whole chunks, the last possibly shorter."""
    for float8 in (False, True):
        for tiles in range(1, 1100):
            for chunks in (1, 2, 3, 7, 8, 12, 16, 33, 64, 256):
                splits = kernels.rows_splits(tiles, chunks, float8)
                assert 1 <= splits <= chunks
                assert splits == 1 or tiles <= kernels.SPLIT_MAX_TILES
                run = -(-chunks // splits)
                assert (splits - 1) * run < chunks  # the last program's run is not empty


ROTARY_CPU = [(1, 1, 9, 3, 64, False), (2, 5, 4, 2, 128, True), (2, 3, 3, 1, 80, False)]  # B, T, Hq, Hkv, D, strided


@pytest.mark.parametrize("case", ROTARY_CPU, ids=lambda c: "B{}-T{}-Hq{}-Hkv{}-D{}".format(*c) + "-strided" * c[5])
@pytest.mark.parametrize("dtype", HALVES, ids=dtype_id)
def test_rotary_interpreter(interpreter, dtype, case):
    interpreter(check_rotary, "cpu", dtype, *case)


@pytest.mark.parametrize("case", [(1, 1, 9, 3, 64), (2, 5, 4, 2, 128), (3, 2, 3, 1, 80)], ids=lambda c:
                         "B{}-T{}-Hq{}-Hkv{}-D{}".format(*c))
@pytest.mark.parametrize("dtype", HALVES, ids=dtype_id)
def test_rotary_store_interpreter(interpreter, dtype, case):
    interpreter(check_rotary_store, "cpu", dtype, *case)


@pytest.mark.parametrize("shape", [(1, 1, 1536), (2, 3, 700)], ids=str)
@pytest.mark.parametrize("dtype", HALVES, ids=dtype_id)
@pytest.mark.parametrize("joint", [False, True], ids=["separate", "joint"])
def test_silu_mul_interpreter(interpreter, dtype, shape, joint):
    interpreter(check_silu_mul, "cpu", dtype, shape, kernels.silu_mul, joint)


@pytest.mark.parametrize("B, T, joint", [(2, 9, False), (1, 1, True)], ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_model_interpreter(interpreter, family, B, T, joint, hf_checkpoint):
    interpreter(check_model, hf_checkpoint(family)[0], "cpu", torch.float32, 1e-5, B, T, joint)


def _norm_without_eps(x, weight, eps):
    return kernels.rms_norm(x, weight, 0.0)


def _unit_norm_weighted(x, weight, eps):
    return kernels.rms_norm(x, torch.full(x.shape[-1:], 1.01, dtype=x.dtype) if weight is None else weight, eps)


def _linear_norm_unweighted(x, weight, bias=None, *, norm, **extra):
    return kernels.fused_linear(x, weight, bias, norm=(None, norm[1]), **extra)


def _linear_unit_norm_skipped(x, weight, bias=None, *, norm, **extra):
    return kernels.fused_linear(x, weight, bias, **extra)


def _linear_silu_of_up(x, weight, bias=None, **extra):
    return kernels.fused_linear(x, torch.cat(weight.chunk(2)[::-1]), bias, **extra)


def _linear_without_residual(x, weight, bias=None, *, residual, donate_residual, **extra):
    return kernels.fused_linear(x, weight, bias, **extra)


def _rotary_sin_negated(q, k, cos, sin):
    return kernels.rotary(q, k, cos, -sin)


def _store_k_unrotated(q, k, v, cos, sin, slots, k_cache, v_cache):
    q_out = kernels.rotary_store(q, k, v, cos, sin, slots, k_cache, v_cache)
    k_cache[slots] = k
    return q_out


def _silu_of_up(gate, up):
    return kernels.silu_mul(up, gate)


def _linear_ignoring_fp8(x, weight, bias=None, *, fp8, **extra):
    return kernels.fused_linear(x, weight, bias, **extra)


def _fp8_scales_rolled(x, weight, bias=None, *, fp8, **extra):
    copy = fp8.get(weight)
    return kernels.fused_linear(x, weight, bias, fp8=_fp8_table(weight, Fp8Weight(copy.values, copy.scale.roll(1))),
                                **extra)


def _rows_split_finished_early(x, weight, bias=None, **extra):
    """A tile's count starting at 1 (a count left over, or a program counted twice): its next-to-last program (of five)
    finishes it before the last one's sums are in."""
    counters = kernels._split_counters(x.device)
    counters.fill_(1)
    try:
        return kernels.fused_linear(x, weight, bias, **extra)
    finally:
        counters.zero_()


@pytest.mark.parametrize("check, args", [
    (check_rms_norm, ("cpu", torch.float32, 7, 96, False, None, False, _norm_without_eps)),
    (check_rms_norm, ("cpu", torch.float32, 7, 96, False, None, True, _unit_norm_weighted)),
    (check_fused_linear, ("cpu", torch.float32, 1, 40, 300, True, False, True, False, False, _linear_norm_unweighted)),
    (check_fused_linear, ("cpu", torch.float32, 5, 64, 1300, "unit", True, False, False, False,
                          _linear_unit_norm_skipped)),
    (check_fused_linear, ("cpu", torch.float16, 3, 40, 96, "unit", False, True, False, False,
                          _linear_unit_norm_skipped)),
    (check_fused_linear, ("cpu", torch.float32, 1, 66, 1100, False, True, False, False, False, _linear_silu_of_up)),
    (check_fused_linear, ("cpu", torch.float16, 3, 70, 300, False, True, False, False, False, _linear_silu_of_up)),
    (check_fused_linear, ("cpu", torch.float32, 1, 600, 64, True, True, False, True, False, _linear_without_residual)),
    (check_fused_linear, ("cpu", torch.float16, 3, 40, 96, False, False, False, True, False,
                          _linear_without_residual)),
    (check_fused_linear, ("cpu", torch.float32, 1, 40, 300, True, False, True, True, True, _linear_ignoring_fp8)),
    (check_fused_linear, ("cpu", torch.float16, 3, 512, 32768, False, False, True, False, True, _fp8_scales_rolled)),
    (check_fused_linear, ("cpu", torch.float16, 4, 40, 1600, False, False, True, False, False,
                          _rows_split_finished_early)),
    (check_rotary, ("cpu", torch.float32, 2, 5, 4, 2, 128, True, _rotary_sin_negated)),
    (check_rotary_store, ("cpu", torch.float32, 2, 5, 4, 2, 128, _store_k_unrotated)),
    (check_silu_mul, ("cpu", torch.float32, (2, 3, 700), _silu_of_up)),
], ids=["norm-without-eps", "unit-norm-weighted", "linear-norm-unweighted", "unit-norm-skipped",
        "rows-unit-norm-skipped", "linear-silu-of-up", "rows-silu-of-up", "linear-without-residual",
        "rows-without-residual", "linear-ignoring-fp8",
        "rows-fp8-scales-rolled", "rows-split-finished-early", "rotary-sin-negated", "store-k-unrotated",
        "silu-of-up"])
def test_checks_catch_wrong_kernels(interpreter, check, args):
    """The comparisons can fail: subtly wrong uses of each kernel are caught."""
    triton_interpreter.raises_in_comparison(interpreter, check, *args)


def test_rows_view_or_copy():
    """Row-strided inputs reach the kernel as views, column-strided ones as copies."""
    x = torch.randn(4, 3, 10)[..., :8]
    assert kernels.as_rows(x).data_ptr() == x.data_ptr() and kernels.as_rows(x).stride() == (10, 1)
    y = torch.randn(8, 4).T
    assert kernels.as_rows(y).is_contiguous() and kernels.as_rows(y).data_ptr() != y.data_ptr()


def test_every_kernel_waits_for_the_one_before():
    """Under programmatic dependent launch (`launch_options`, Hopper on) a kernel may start before the one before
    it has finished, so each must call `follow(PDL)` before it touches memory: one that did not could read inputs not
    yet written, or overwrite memory still being read. Four read before it what the kernel before them never writes,
    and nothing else: the linear kernels their first weights (the few-rows kernel also asks L2 for the rest), the
    rotary store its cos, sin and cache slot (written before the projection it follows), the paged attention its
    prefix lengths (written before the layers). None writes before it. Off CUDA the option is off."""
    from triton.runtime.jit import JITFunction

    from eyas.serve import step_kernels
    from eyas.serve.attention import triton_paged

    launched = {name: fn for module in (kernels, step_kernels, triton_paged) for name, fn in vars(module).items()
                if isinstance(fn, JITFunction) and name.endswith("_kernel")}
    assert len(launched) == 20
    # The pointers each may load through before the wait (c and s point into cos and sin).
    reads_before_wait = {"_fused_linear_kernel": {"rows"}, "_rows_matmul_kernel": {"w_rows"},
                         "_rotary_kernel": {"c", "s", "slots_ptr"}, "_paged_attention_kernel": {"prefix_lens_ptr"}}
    for name, fn in launched.items():
        body = ast.parse(fn.src).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        code = [ast.unparse(statement) for statement in body]
        assert "follow(PDL)" in code, f"{name} never calls follow(PDL)"
        before = code[:code.index("follow(PDL)")]
        if name in reads_before_wait:
            early = " ".join(before)
            assert "store" not in early and "atomic" not in early, f"{name} writes before follow"
            reads = set(re.findall(r"(?:tl\.load|_weights_to_l2)\((\w+)", early))
            assert reads == reads_before_wait[name], f"{name} reads through {reads} before follow"
            helpers = set(re.findall(r"(?<![\w.])(_\w+)\(", early)) - {"_weights_to_l2"}
            assert not helpers, f"{name} calls {helpers} before follow"
        else:
            assert not before, f"{name} starts with {before[0]!r}"
    assert kernels.launch_options(torch.device("cpu")) == {"PDL": 0}
