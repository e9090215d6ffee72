"""The training benchmark's profile: a measured step's operators, counted per step over the steps after warm-up."""

import re

import pytest
import torch

from eyas.common.architectures import architecture_config
from eyas.train import bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the operators a CPU run calls (the trainer takes the GPU "
                    "where there is one, and the profile then lists its kernels)")
def test_profile_counts_each_measured_step(capsys):
    ttt_steps = 3
    overrides = ["model.random_arch=tiny", "data.synthetic.seq_len=32", "model.draft_vocab_size=64",
                 "optim.total_steps=4", f"ttt.steps={ttt_steps}"]
    bench.main(["--recipe", "bench-llama3.1-8b", *(a for o in overrides for a in ("--set", o)), "--warmup", "1",
                "--profile", "100"])
    out = capsys.readouterr().out
    assert "operators of a step (mean of 3 steps)" in out
    linear = re.search(r"^\s+([\d.]+)x\s+[\d.]+ ms, charged\s+[\d.]+\s+aten::linear$", out, re.MULTILINE)
    # Per step: the target's 7 projections a layer (its lm_head is a matmul), then the head's fc once and, per
    # unrolled step, its 7 projections and its lm_head.
    layers = architecture_config("tiny").num_hidden_layers
    assert linear and float(linear.group(1)) == 7 * layers + 1 + 8 * ttt_steps


def test_a_warmup_that_leaves_no_step_to_measure_is_refused_before_training(capsys, monkeypatch):
    monkeypatch.setattr(bench, "train", lambda *a: pytest.fail("trained although nothing could be measured"))
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--recipe", "bench-llama3.1-8b", "--set", "optim.total_steps=5", "--warmup", "5"])
    assert stopped.value.code == 2 and "leaves none of the recipe's 5 steps" in capsys.readouterr().err
