"""The few-rows linear benchmark: the weights it measures are the served model's, its grid the launches the kernel
runs, and on a GPU it times each; without one it compiles each and reads its registers (--resources)."""

import json

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from eyas.common.architectures import architecture_config  # noqa: E402
from eyas.common.layers import fuse_projections  # noqa: E402
from eyas.common.target import TargetModel  # noqa: E402
from eyas.serve import kernels, linear_bench  # noqa: E402
from eyas.serve.bench import random_head  # noqa: E402


@pytest.mark.parametrize("arch", ["tiny", "smollm2-135m"])
def test_weight_shapes_are_the_served_models(arch):
    """q/k/v and gate/up joined as the engine serves them; only gate/up's output goes through SiLU·mul."""
    with torch.device("meta"):
        target = TargetModel(architecture_config(arch))
    fuse_projections(target)
    layer = target.model.layers[0]
    served = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
              "down": layer.mlp.down_proj}
    shapes = linear_bench.weight_shapes(arch)
    assert {name: shapes[name][:2] for name in served} == {name: tuple(m.weight.shape) for name, m in served.items()}
    assert shapes["lm_head"][:2] == tuple(target.lm_head_weight.shape)
    assert [name for name, (_, _, silu) in shapes.items() if silu] == ["gate_up"]


@pytest.mark.parametrize("draft_vocab", [None, 100])
def test_head_weight_shapes_are_the_served_heads(draft_vocab):
    """An EAGLE-3 head's as the engine serves a random one (bench-eagle's): q/k/v over the embedding and the stream
    side by side, fc over the target's three captured streams, the lm_head over the draft vocabulary (by default
    32,000, at most the target's 512)."""
    arch = "tiny"
    cfg = architecture_config(arch)
    head = random_head(TargetModel(cfg), draft_vocab)
    fuse_projections(head)
    layer = head.midlayer
    served = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
              "down": layer.mlp.down_proj, "lm_head": head.lm_head, "fc": head.fc}
    shapes = linear_bench.head_weight_shapes(arch, draft_vocab)
    assert {name: shape[:2] for name, shape in shapes.items()} == {n: tuple(m.weight.shape) for n, m in served.items()}
    assert shapes["qkv"][1] == 2 * cfg.hidden_size and shapes["fc"][1] == 3 * cfg.hidden_size
    assert shapes["lm_head"][0] == (draft_vocab or cfg.vocab_size)
    assert [name for name, (_, _, silu) in shapes.items() if silu] == ["gate_up"]


def test_the_grid_holds_each_launch_as_the_kernel_runs_it_once():
    """Splits become equal runs of whole chunks (so 2 and 3 over 4 chunks are one launch, of 2), and a split over
    more tiles than the kernel has counters for is left out."""
    grid = [kernels.RowsLaunch(32, 256, 4, 4, s) for s in (1, 2, 3, 4)] + [kernels.RowsLaunch(16, 256, 4, 4, 2)]
    runs = linear_bench.as_launched(grid, 4096, 1024)
    assert runs == [kernels.RowsLaunch(32, 256, 4, 4, 1), kernels.RowsLaunch(32, 256, 4, 4, 2),
                    kernels.RowsLaunch(32, 256, 4, 4, 4), kernels.RowsLaunch(16, 256, 4, 4, 2)]
    wide = linear_bench.as_launched(grid, 16 * kernels.SPLIT_MAX_TILES + 16, 1024)
    assert wide == [kernels.RowsLaunch(32, 256, 4, 4, 1), kernels.RowsLaunch(32, 256, 4, 4, 2),
                    kernels.RowsLaunch(32, 256, 4, 4, 4)]


def test_rows_outside_the_kernels_range_and_a_json_without_its_folder_are_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        linear_bench.main(["--rows", "1", "8"])
    assert "--rows [1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        linear_bench.main(["--json", str(tmp_path / "missing" / "t.json")])
    assert "no directory" in capsys.readouterr().err
    for head_only in (["--weights", "fc"], ["--draft-vocab", "8192"]):
        with pytest.raises(SystemExit):
            linear_bench.main(head_only)
        assert "(--head)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        linear_bench.main(["--head", "--draft-vocab", "0"])
    assert "--draft-vocab" in capsys.readouterr().err


def test_resources_of_a_heads_fc(capsys):
    linear_bench.main(["--arch", "smollm2-135m", "--head", "--fp8", "--rows", "8", "--weights", "fc", "--block-n", "32",
                       "--block-k", "64", "--stages", "2", "--splits", "1", "--resources"])
    out = capsys.readouterr().out.splitlines()
    assert "smollm2-135m's EAGLE-3 head, float8 weights" in out[0]
    assert [line.split()[:3] for line in out[2:]] == [["fc", "576x1728", "8"]] * 2  # the served launch, the grid's


@pytest.mark.parametrize("fp8", [False, True])
def test_resources_lists_the_served_launch_then_each_of_the_grid_compiled_without_a_gpu(capsys, fp8):
    linear_bench.main(["--arch", "smollm2-135m", "--rows", "64", "--weights", "gate_up", "down", "--block-n", "32",
                       "--block-k", "64", "128", "--stages", "4", "--warps", "4", "8", "--splits", "1", "--resources"]
                      + ["--fp8"] * fp8)
    rows = [line.split(maxsplit=6) for line in capsys.readouterr().out.splitlines()[2:]]
    grid = [f"(32, {k}, 4, {w}, 1)" for k in (64, 128) for w in (4, 8)]
    for name, N, K in [("gate_up", 3072, 576), ("down", 576, 1536)]:
        listed = [row for row in rows if row[0] == name]
        silu = name == "gate_up"
        served = "*" + str(tuple(kernels.rows_launch(64, N // 2 if silu else N, K, fp8, silu)))
        assert listed[0][6] == served and not any(row[6].startswith("*") for row in listed[1:])
        assert sorted(row[6].lstrip("*") for row in listed) == sorted(set(grid + [served[1:]]))
        assert all(0 < int(row[3]) <= 255 and int(row[4]) >= 0 for row in listed)  # registers, stack bytes
        assert all(0 < int(row[5]) <= 227 for row in listed)  # KB of shared memory, at most a program's on Hopper


def test_a_launch_without_the_shared_memory_is_kept_untimed_and_the_sweep_goes_on(monkeypatch):
    """On an H200 (64, 128, 4 stages) at 64 rows of SmolLM2's gate/up asks 245,760 bytes of shared memory: the
    sweep used to stop there."""
    def rows_kernel(x, weight, bias, silu, copy, launch):
        if launch is not None and launch.block_n == 64:  # the served launch is None
            raise OutOfResources(245760, 232448, "shared memory")

    monkeypatch.setattr(kernels, "rows_kernel", rows_kernel)
    monkeypatch.setattr(kernels, "fused_linear", lambda x, weight, **options: None)  # the one-row column's
    def us_per_call(call, copies):
        call(0)
        return 1.0

    monkeypatch.setattr(linear_bench, "us_per_call", us_per_call)
    grid = [kernels.RowsLaunch(n, 128, 4, 4, 1) for n in (32, 64)]
    record = linear_bench.measure(64, 32, False, 64, grid, False, "cpu")
    assert record["grid"] == [(grid[0], 1.0), (grid[1], None)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_launch_too_big_for_the_gpu_is_listed_untimed(capsys):
    # The premise, from the compiler: four stages of (32, 256) tiles at 64 rows need more shared memory than this
    # GPU's SM has (256 KB; an H100's or H200's has 227), (32, 128) ones fit (128 KB).
    N, K, silu = linear_bench.weight_shapes("smollm2-135m")["gate_up"]
    launches = [kernels.RowsLaunch(32, block_k, 4, 4, 1) for block_k in (128, 256)]
    shared = [used.shared for _, used in linear_bench.launch_resources(N, K, silu, 64, launches, False)]
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    assert shared[0] <= limit < shared[1], f"shared memory {shared} against {limit}: pick another launch"
    linear_bench.main(["--arch", "smollm2-135m", "--rows", "64", "--weights", "gate_up", "--block-n", "32",
                       "--block-k", "128", "256", "--stages", "4", "--splits", "1"])
    out = capsys.readouterr().out
    assert "(32, 128, 4, 4, 1)" in out.splitlines()[2]
    assert "(32, 256, 4, 4, 1)  needs more shared memory than an SM has" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8, head", [(False, False), (True, False), (True, True)])
def test_every_weight_is_timed(capsys, tmp_path, fp8, head):
    linear_bench.main(["--arch", "smollm2-135m", "--rows", "4", "--block-n", "16", "--block-k", "64", "--stages", "2",
                       "--splits", "1", "2", "--all", "--json", str(tmp_path / "t.json")] + ["--fp8"] * fp8
                      + ["--head"] * head)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    timed = [row for row in rows if row[0] in ("qkv", "o", "gate_up", "down")]
    assert [row[0] for row in timed] == ["qkv", "o", "gate_up", "down"]
    assert all(0 < float(us) < 1e4 for row in timed for us in row[3:7])  # cuBLAS, one row, served, best
    assert len(rows) == 4 * 3  # each weight, then its two launches
    records = json.loads((tmp_path / "t.json").read_text())
    assert [(r["name"], r["rows"], r["fp8"]) for r in records] == [(n, 4, fp8) for n in ("qkv", "o", "gate_up", "down")]
    assert all(0 < r["one_row_us"] < 1e4 for r in records)
    assert [[launch[4] for launch, _ in r["grid"]] for r in records] == [[1, 2]] * 4  # 9 to 24 chunks of 64 split
