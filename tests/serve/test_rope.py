"""Rotary tables looked up (serve/rope.py) equal the tables `Rotary` computes, value for value."""

import pytest
import torch

from eyas.common.config import RopeConfig
from eyas.common.layers import Rotary
from eyas.serve.rope import RopeTable, rope_tables

LLAMA3 = RopeConfig(theta=500000.0, type="llama3", factor=8.0, original_max_position_embeddings=64)


@pytest.mark.parametrize("rope", [RopeConfig(), LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lookup_equals_rotary(rope, dtype):
    rotary = Rotary(rope, 16)
    table = RopeTable(rotary, 300, dtype)
    positions = torch.tensor([[0, 1, 299], [150, 64, 7]])
    for looked_up, computed in zip(table(positions), rotary(positions, dtype), strict=True):
        assert looked_up.shape == computed.shape == (2, 3, 16) and looked_up.dtype == dtype
        assert torch.equal(looked_up, computed)


def test_one_table_per_setting():
    default, other_dim, other_rope = Rotary(RopeConfig(), 16), Rotary(RopeConfig(), 8), Rotary(LLAMA3, 16)
    same = rope_tables([default, Rotary(RopeConfig(), 16)], 10, torch.float32)
    assert same[0] is same[1]
    tables = rope_tables([default, other_dim, other_rope], 10, torch.float32)
    assert len({id(t) for t in tables}) == 3 and tables[1].table.shape == (10, 16)
