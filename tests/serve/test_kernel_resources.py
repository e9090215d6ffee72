"""The linear kernels as served at SmolLM2's and Llama-3.1-8B's shapes keep their values in registers: compiled for
sm_90 on the CPU (`eyas.serve.hopper_compile`), no launch spills more than a few values to the stack.

A kernel that runs out of registers keeps values in local memory, which costs far more than the work it saves: the
add and RMSNorm folded into the few-rows matmul (9e48114) took 2.7-3.0 KB of stack a thread at 48 and 64 rows and
made a SmolLM2 verification 1.47 against 1.02 ms (docs/perf.md, twenty-seventh entry). The launches are those that
`fused_linear` makes, with its own dispatch (one row, a few rows, float8 copies), recorded on meta tensors.
"""

import pytest
import torch

from eyas.serve.fp8 import Fp8Weights

pytest.importorskip("triton", reason="triton is not installed (the fused kernels are optional)")
from eyas.serve import hopper_compile, kernels  # noqa: E402  (needs triton)
from eyas.serve.linear_bench import meta_operands, weight_shapes  # noqa: E402

STACK_MAX = 64  # bytes a thread: a few spilled values (the served gate/up takes 24 at 48 and 64 rows)
NORMED = ("qkv", "gate_up")  # the linears after a layer's add and RMSNorm


def served_launches(arch: str, rows: int, float8: bool) -> set[hopper_compile.Launch]:
    """The launches `fused_linear` makes for each of the target's linears (`weight_shapes`, less the lm_head) at
    `rows` rows, with float8 copies of the weights where `float8`."""
    def run_linears():
        for name, (N, K, silu) in weight_shapes(arch).items():
            if name == "lm_head":
                continue
            x, weight, copy = meta_operands(N, K, rows, float8)
            copies = Fp8Weights()
            if copy is not None:
                copies.add(weight, copy)
            normed = name in NORMED
            kernels.fused_linear(x, weight, residual=torch.empty_like(x) if normed else None,
                                 norm=(torch.empty_like(weight[0]), 1e-5) if normed else None,
                                 silu_mul_output=silu, fp8=copies)

    return hopper_compile.recorded_launches(run_linears)


CASES = [("smollm2-135m", rows, False) for rows in (1, 4, 16, 48, 64)] + [
    ("llama-3.1-8b", 1, False)] + [("llama-3.1-8b", rows, True) for rows in (1, 4, 16)]


@pytest.mark.parametrize("arch, rows, float8", CASES, ids=lambda c: str(c))
def test_served_linear_launches_do_not_spill(arch, rows, float8):
    launches = served_launches(arch, rows, float8)
    assert launches, "fused_linear launched no kernel"
    for launch in launches:
        used = hopper_compile.resources(launch)
        assert used.stack <= STACK_MAX, (f"{launch.kernel} spills {used.stack} bytes a thread ({used.registers} "
                                         f"registers) at {rows} rows of {arch}: {dict(launch.constexprs)}")
