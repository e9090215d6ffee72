"""The linear kernels as served at SmolLM2's and Llama-3.1-8B's shapes keep their values in registers: compiled for
sm_90 on the CPU (`eyas.serve.hopper_compile`), no launch spills more than a few values to the stack.

A kernel that runs out of registers keeps values in local memory, which can cost more than the work it saves (the
add and RMSNorm folded into the few-rows matmul, 9e48114, took 244-254 registers a thread at 48 and 64 rows, against
78-106 as served, and made a SmolLM2 verification 1.47 against 1.02 ms: docs/perf.md, twenty-seventh and
thirty-first entries). The launches are those that `fused_linear` makes, with its own dispatch (one row, a few rows,
float8 copies), recorded on meta tensors and specialized as the GPU's launcher specializes them.
"""

import functools

import pytest

from eyas.serve.fp8 import Fp8Weights

pytest.importorskip("triton", reason="triton is not installed (the fused kernels are optional)")
from eyas.serve import hopper_compile, kernels  # noqa: E402  (needs triton)
from eyas.serve.linear_bench import meta_operands, weight_shapes  # noqa: E402

STACK_MAX = 64  # bytes a thread: a few spilled values (no served launch spills any)
SM_SHARED_MEMORY = 228 << 10  # an H100's or H200's SM, of which each resident program takes 1 KB more than it asks
NORMED = ("qkv", "gate_up")  # the linears after a layer's RMSNorm (folded into them, as served)
ADDING = ("o", "down")  # the linears that add the residual stream


def served_launches(arch: str, rows: int, float8: bool) -> set[hopper_compile.Launch]:
    """The launches `fused_linear` makes for each of the target's linears (`weight_shapes`, less the lm_head) at
    `rows` rows, with float8 copies of the weights where `float8`; gate/up on o's output, as a layer's MLP takes it
    (with its rows' squares where a few-rows call wrote it: `kernels.RowSquares`)."""
    def run_linears():
        out = None
        for name, (N, K, silu) in weight_shapes(arch).items():
            if name == "lm_head":
                continue
            x, weight, copy = meta_operands(N, K, rows, float8)
            x = out if name == "gate_up" else x
            copies = Fp8Weights()
            if copy is not None:
                copies.add(weight, copy)
            stream = x.new_empty(*x.shape[:-1], N) if name in ADDING else None
            out = kernels.fused_linear(x, weight, norm=(None, 1e-5) if name in NORMED else None,
                                       silu_mul_output=silu, residual=stream, donate_residual=name == "down",
                                       fp8=copies)

    return hopper_compile.recorded_launches(run_linears)


CASES = [("smollm2-135m", rows, False) for rows in (1, 4, 16, 48, 64)] + [
    ("llama-3.1-8b", rows, False) for rows in (1, 8)] + [("llama-3.1-8b", rows, True) for rows in (1, 4, 16)]


@pytest.mark.parametrize("arch, rows, float8", CASES, ids=lambda c: str(c))
def test_served_linear_launches_do_not_spill(arch, rows, float8):
    launches = served_launches(arch, rows, float8)
    assert launches, "fused_linear launched no kernel"
    for launch in launches:
        used = hopper_compile.resources(launch)
        assert used.stack <= STACK_MAX, (f"{launch.kernel} spills {used.stack} bytes a thread ({used.registers} "
                                         f"registers) at {rows} rows of {arch}: {dict(launch.constexprs)}")


def test_launches_compile_as_the_gpu_launcher_specializes_them():
    """Aligned pointers and integers divisible by 16 carry Triton's divisibility mark, as the GPU launcher gives it,
    and an integer 1 is a constant. Without the marks the compiler neither vectorizes the few-rows matmul's loads nor
    pipelines them through shared memory (no cp.async), and a thread's registers and stack were another kernel's:
    the served 64-row launch at the register cap, the paged attention spilling, where neither is (docs/perf.md,
    thirty-first entry)."""
    x, weight, _ = meta_operands(6144, 4096, 8, False)
    (launch,) = hopper_compile.recorded_launches(lambda: kernels.rows_kernel(x, weight))
    assert {"x_ptr", "w_ptr", "out_ptr", "N", "K", "stride_x"} <= set(launch.aligned)
    assert "M" not in launch.aligned and dict(launch.signature)["M"] == "i32"  # 8 rows: not a multiple of 16
    assert "cp.async" in hopper_compile.compile_launch(launch).asm["ptx"]
    (one_row,) = hopper_compile.recorded_launches(lambda: kernels.rows_kernel(x[:1], weight))
    assert dict(one_row.constexprs)["M"] == 1


def test_kernels_released_late_let_the_next_launch_only_at_their_end():
    """Compiled as a Hopper GPU's launcher takes each (`recorded_launches`): under PDL a kernel waits for the one
    before (griddepcontrol.wait); launched as served it then lets the next kernel launch
    (griddepcontrol.launch_dependents), and within `releasing_late` it does not, so the next launches as its programs
    end. A long call that shares SMs (an 8B head's down at 4 rows on its float8 copy) launches without PDL as served,
    and under it, late, within `releasing_late`; one that holds a whole SM (an 8B target's down at 8 rows) launches
    early either way."""
    short = meta_operands(1536, 576, 8, False)  # a SmolLM2 layer's gate
    shared = meta_operands(4096, 14336, 4, True)
    whole = meta_operands(4096, 14336, 8, False)

    def ptx(x, weight, copy):
        (launch,) = hopper_compile.recorded_launches(lambda: kernels.rows_kernel(x, weight, quantized=copy))
        return dict(launch.constexprs)["PDL"], hopper_compile.compile_launch(launch).asm["ptx"]

    served = {"short": ptx(*short), "shared": ptx(*shared), "whole": ptx(*whole)}
    with kernels.releasing_late():
        late = {"short": ptx(*short), "shared": ptx(*shared), "whole": ptx(*whole)}
    for pdl, code in (served["short"], served["whole"], late["whole"]):
        assert pdl == kernels.EARLY.value
        assert "griddepcontrol.wait" in code and "griddepcontrol.launch_dependents" in code
    assert served["shared"][0] == 0 and "griddepcontrol" not in served["shared"][1]
    for pdl, code in (late["short"], late["shared"]):
        assert pdl == kernels.LATE.value
        assert "griddepcontrol.wait" in code and "griddepcontrol.launch_dependents" not in code


@pytest.mark.parametrize("arch, rows, float8", [("llama-3.1-8b", rows, False) for rows in (4, 8, 17, 32, 48, 64)] + [
    ("llama-3.1-8b", 4, True), ("smollm2-135m", 16, False)], ids=lambda c: str(c))
def test_whole_sm_calls_are_those_whose_program_fills_an_sm(arch, rows, float8):
    """`whole_sm_call` names the served few-rows launches that launch early even where kernels release late
    (`launch_options`), as no SM can run two of their programs: those whose program asks more than half an SM's
    shared memory, and no more than WHOLE_SM_SHARED. An 8B target's calls on bf16 weights at verification are; the
    float8 copies' (a draft head's passes) and SmolLM2's are not."""
    found = {}
    for name, (N, K, silu) in weight_shapes(arch).items():
        if name == "lm_head":  # cuBLAS's
            continue
        x, weight, copy = meta_operands(N, K, rows, float8)
        (spec,) = hopper_compile.recorded_launches(functools.partial(kernels.rows_kernel, x, weight, None, silu, copy))
        shared = hopper_compile.resources(spec).shared + 1024
        assert shared <= SM_SHARED_MEMORY, f"{name} at {rows} rows asks {shared} bytes of shared memory"
        found[name] = 2 * shared > SM_SHARED_MEMORY
        assert found[name] == kernels.whole_sm_call(rows, N, K, float8), f"{name} at {rows} rows: {shared} bytes"
        assert not found[name] or shared <= kernels.WHOLE_SM_SHARED, f"{name} at {rows} rows: {shared} bytes"
    assert found and any(found.values()) == (arch == "llama-3.1-8b" and not float8)
