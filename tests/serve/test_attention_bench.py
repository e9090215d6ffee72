"""The attention benchmark's --resources: without a GPU, each case's Triton launches compiled for sm_90, the
attention kernel at its served warps first, then at each other asked for."""

import pytest

pytest.importorskip("triton")

from eyas.serve.attention import bench, triton_paged  # noqa: E402


def test_resources_lists_each_cases_launches_served_first(capsys):
    bench.main(["--arch", "smollm2-135m", "--resources", "--warps", "8"])
    lines = capsys.readouterr().out.splitlines()
    assert "Hq 9, Hkv 3, D 64" in lines[0]
    rows = [line.split() for line in lines[2:]]
    h = bench.heads("smollm2-135m")
    for name, B, T, W, prefix in bench.CASES:
        case = [row for row in rows if row[:5] == [name, str(B), str(T), str(W), str(prefix)]]
        attention = [row for row in case if row[5] == "_paged_attention_kernel"]
        max_keys = -(-(prefix + W) // 16) * 16  # the block table's reach, in blocks of 16
        block_m, block_n, splits, warps = triton_paged.launch_config(B, T * h.q // h.kv, h.kv, max_keys, 132)
        assert [row[6:9] for row in attention] == [[str(block_m), str(block_n), str(warps)]] + (
            [[str(block_m), str(block_n), "8"]] if warps != 8 else [])
        assert any(row[5] == "_merge_splits_kernel" for row in case) == (splits > 1)
        assert all(0 < int(row[9]) <= 255 and int(row[10]) >= 0 for row in case)  # registers, stack bytes
