"""Attention backends: each turns the q/k/v of new tokens into attention output over a paged KV cache.

`torch` (torch_sdpa.py) gathers keys and runs SDPA: the reference, runs anywhere. `triton` (triton_paged.py)
reads the cache in place and launches no host-dependent shapes, so it can be captured in CUDA graphs.
`flashinfer` (flashinfer_paged.py) runs FlashInfer's paged prefill under a custom mask, eagerly (it plans on
the host); it needs `flashinfer-python` and CUDA.
"""

from __future__ import annotations

import importlib.util

import torch

from eyas.common.config import ConfigError

from .paged import PagedAttention

BACKENDS = ("auto", "torch", "triton", "flashinfer")


def attention_backend(name: str, device: torch.device) -> type[PagedAttention]:
    """The backend class for `name`; "auto" is triton on CUDA when triton is installed, else torch. A backend unknown
    or unavailable on `device` is a ConfigError."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"
    if name == "torch":
        from .torch_sdpa import TorchPagedAttention

        return TorchPagedAttention
    if name == "triton":
        from .triton_paged import TritonPagedAttention, available

        if not available(device):
            raise ConfigError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1)")
        return TritonPagedAttention
    if name == "flashinfer":
        if device.type != "cuda" or not importlib.util.find_spec("flashinfer"):
            raise ConfigError("the flashinfer attention backend needs a CUDA device and flashinfer-python installed")
        from .flashinfer_paged import FlashInferPagedAttention

        return FlashInferPagedAttention
    raise ConfigError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
