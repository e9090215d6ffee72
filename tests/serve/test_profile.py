"""The kernel profile counts each decode-step phase's launches (operators on CPU): speculation's phases have work,
plain decoding's draft phase has next to none."""

import torch

from eyas.common.architectures import random_target
from eyas.serve import profile
from eyas.serve.bench import random_head
from eyas.serve.draft import TreeShape
from eyas.serve.sampling import SamplingParams


def test_phases_are_counted():
    target = random_target("tiny", torch.float32, "cpu")
    head = random_head(target)
    prompt = list(range(40))
    plain = profile.profile_setting(target, head, None, prompt, 8)
    tree = profile.profile_setting(target, head, TreeShape(3, 2, 4), prompt, 8)
    assert set(plain) == set(tree) == set(profile.PHASES)
    assert tree["draft"].launches > 10 * max(plain["draft"].launches, 1)  # a tree's passes against a root alone
    assert all(p.launches > 0 and p.kernels for p in (plain["verify"], tree["verify"], tree["accept"]))
    linear = {name: per_step for name, per_step, _ in tree["draft"].kernels}["aten::linear"]
    assert linear == 2 * 5  # two draft passes, each: the joined qkv, o, the joined gate/up, down, the lm_head


def test_cli_prints_every_setting(capsys):
    profile.main(["--arch", "tiny", "--trees", "off", "3,2,4", "--input-len", "30", "--new-tokens", "6", "--top", "2"])
    out = capsys.readouterr().out
    assert "== tiny off: operators a decode step draft" in out and "== tiny 3,2,4:" in out


def test_sampled_verification_is_counted():
    """At a temperature the verify phase holds the sampled walk's work too: more operators than greedy's, among them
    the draw of the bonus token (`searchsorted`)."""
    target = random_target("tiny", torch.float32, "cpu")
    head = random_head(target)
    prompt, shape = list(range(40)), TreeShape(3, 2, 4)
    greedy = profile.profile_setting(target, head, shape, prompt, 8)
    sampled = profile.profile_setting(target, head, shape, prompt, 8, SamplingParams(temperature=0.8, top_p=0.9))
    assert sampled["verify"].launches > greedy["verify"].launches
    assert "aten::searchsorted" in {name for name, _, _ in sampled["verify"].kernels}

