"""Host-to-device copies that do not wait for the device.

A copy from pageable host memory to CUDA returns only once the stream's earlier work is done. The engine queues a
decode step behind the one in flight (`Engine.step`), and any such copy in between would stall it until the GPU
caught up, undoing the overlap; a copy through pinned memory is queued like a kernel instead.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(x: Tensor, device: torch.device | str | None) -> Tensor:
    """Host tensor `x` on `device` (None: where it is), queued behind the stream's work on CUDA."""
    device = torch.device(device) if device is not None else x.device
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
