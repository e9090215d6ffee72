"""The linear kernels as served at SmolLM2's and Llama-3.1-8B's shapes keep their values in registers: compiled for
sm_90 on the CPU (tests/triton_hopper.py), no launch spills more than a few values to the stack.

A kernel that runs out of registers keeps values in local memory, which costs far more than the work it saves: the
add and RMSNorm folded into the few-rows matmul (9e48114) took 2.7 KB of stack a thread at 64 rows and made a
SmolLM2 verification 1.47 against 1.02 ms (docs/perf.md, twenty-seventh entry). The launches are the ones
`fused_linear` makes, with its own dispatch (one row, a few rows, float8 copies), recorded instead of run, on
meta tensors of each layer's shapes.
"""

import pytest
import torch

from eyas.common.architectures import architecture_config
from eyas.serve.fp8 import E4M3, Fp8Weight, Fp8Weights
from tests import triton_hopper

pytest.importorskip("triton", reason="triton is not installed (the fused kernels are optional)")
from triton.runtime.jit import JITFunction  # noqa: E402

from eyas.serve import kernels  # noqa: E402  (needs triton)

STACK_MAX = 64  # bytes a thread: a few spilled values (the few-rows matmul with SiLU·mul takes 24 at 64 rows)


def layer_linears(arch: str) -> dict[str, tuple[int, int, bool, bool]]:
    """name -> (N, K, normed with a residual, SiLU·mul) of a target layer's linears and the EAGLE-3 head's fc."""
    c = architecture_config(arch)
    H, D = c.hidden_size, c.head_dim
    return {"qkv": ((c.num_attention_heads + 2 * c.num_key_value_heads) * D, H, True, False),
            "o": (H, c.num_attention_heads * D, False, False),
            "gate_up": (2 * c.intermediate_size, H, True, True),
            "down": (H, c.intermediate_size, False, False),
            "head fc": (H, 3 * H, False, False)}


def served_launches(arch: str, rows: int, float8: bool) -> set[triton_hopper.Launch]:
    """The kernel launches of `fused_linear` on each of `layer_linears(arch)` at `rows` rows (with float8 copies of
    the weights where `float8`), recorded instead of run."""
    launches = set()

    class Recorder:
        def __init__(self, kernel: JITFunction):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.add(
                triton_hopper.launch_spec(self.kernel.fn, self.kernel.arg_names, args, kwargs))

    meta = torch.device("meta")
    with pytest.MonkeyPatch.context() as patch:  # undone before the kernels compile: they call each other by name
        for name, value in vars(kernels).items():
            if isinstance(value, JITFunction):
                patch.setattr(kernels, name, Recorder(value))
        for N, K, normed, silu in layer_linears(arch).values():
            x = torch.empty(rows, K, dtype=torch.bfloat16, device=meta)
            weight = torch.empty(N, K, dtype=torch.bfloat16, device=meta)
            copies = Fp8Weights()
            if float8:
                copies.add(weight, Fp8Weight(torch.empty(N, K, dtype=E4M3, device=meta),
                                             torch.empty(N, dtype=torch.float32, device=meta)))
            norm = (torch.empty(K, dtype=torch.bfloat16, device=meta), 1e-5) if normed else None
            kernels.fused_linear(x, weight, residual=torch.empty_like(x) if normed else None, norm=norm,
                                 silu_mul_output=silu, fp8=copies)
    return launches


CASES = [("smollm2-135m", rows, False) for rows in (1, 4, 16, 48, 64)] + [
    ("llama-3.1-8b", 1, False)] + [("llama-3.1-8b", rows, True) for rows in (1, 4, 16)]


@pytest.mark.parametrize("arch, rows, float8", CASES, ids=lambda c: str(c))
def test_served_linear_launches_do_not_spill(arch, rows, float8):
    launches = served_launches(arch, rows, float8)
    assert launches, "fused_linear launched no kernel"
    for launch in launches:
        used = triton_hopper.resources(launch)
        assert used.stack <= STACK_MAX, (f"{launch.kernel} spills {used.stack} bytes a thread ({used.registers} "
                                         f"registers) at {rows} rows of {arch}: {dict(launch.constexprs)}")
