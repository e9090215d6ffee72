"""The graph cache's outputs: the engine reads a graph's outputs after other graphs have replayed (a step's
verification after the accept graph, and in the next step), so no other graph may write where they live."""

import pytest
import torch

from eyas.serve.cuda_graphs import GraphCache, length_bucket, length_buckets


def scratch(x):
    """A graph whose scratch memory (two [n] intermediates, freed when its capture ends) the shared pool can hand
    out again: the size class of the next graph's output."""
    return (((x * 2) + 1).sum(0, keepdim=True),)


def shifted(x):
    return (x + 5,)


@pytest.mark.gpu
def test_outputs_survive_other_graphs_replays():
    """A graph captured after another may get that graph's freed scratch blocks from the shared pool; its outputs
    then must not live there, or every replay of the first graph overwrites them (the serving engine handed out
    garbage tokens that way when a sampled verification graph was captured after the accept graph)."""
    graphs = GraphCache(torch.device("cuda"), enabled=True)
    x = torch.arange(1 << 22, dtype=torch.float32, device="cuda")  # 16 MB a tensor: the allocator's large blocks
    graphs("scratch", scratch, x)
    (out,) = graphs("shifted", shifted, x)
    graphs("scratch", scratch, -x)
    torch.cuda.synchronize()
    assert torch.equal(out, x + 5)


def test_length_buckets():
    """Prefill chunks pad to a power of two from 16 to 256, then to a multiple of 256; the buckets up to a bound are
    the lengths that bound pads to."""
    assert [length_bucket(n) for n in (1, 16, 17, 200, 256, 257, 1000, 1025, 2048)] == [
        16, 16, 32, 256, 256, 512, 1024, 1280, 2048]
    assert length_buckets(1100) == [16, 32, 64, 128, 256, 512, 768, 1024] and length_buckets(15) == []
    assert all(length_bucket(n) in length_buckets(2048) for n in range(1, 2049))
