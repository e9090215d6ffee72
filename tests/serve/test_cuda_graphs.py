"""The graph cache's outputs: the engine reads a graph's outputs after other graphs have replayed (a step's
verification after the accept graph, and in the next step), so no other graph may write where they live."""

import pytest
import torch

from eyas.serve.cuda_graphs import GraphCache


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
