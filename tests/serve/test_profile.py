"""The kernel profile counts each decode-step phase's launches (operators on CPU): speculation's phases have work,
plain decoding's draft phase has next to none. With --idle it measures the GPU's idle time between kernels."""

import collections
from types import SimpleNamespace

import pytest
import torch

from eyas.common.architectures import random_target
from eyas.common.profiling import KernelKind, idle_time, per_step
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
    linear = {k.name: k.launches for k in tree["draft"].kernels}["aten::linear"]
    assert linear == 2 * 5  # two draft passes, each: the joined qkv, o, the joined gate/up, down, the lm_head


def test_cli_prints_every_setting(capsys):
    profile.main(["--arch", "tiny", "--trees", "off", "3,2,4", "--input-len", "30", "--new-tokens", "6", "--top", "2",
                  "--device", "cpu"])  # operators: on a GPU machine the default device is CUDA
    out = capsys.readouterr().out
    assert "== tiny off: operators a decode step draft" in out and "== tiny 3,2,4:" in out
    # Under each setting's header, up to --top 2 rows a phase (its operators a step, µs, charged µs, name); the
    # tree's every phase has some, and a plain step's verify.
    rows = {block.split(":")[0]: [line.split() for line in block.splitlines()[1:] if line.strip()]
            for block in out.split("== ")[1:]}
    for setting, phases in (("tiny off", {"verify"}), ("tiny 3,2,4", {"draft", "verify", "accept"})):
        listed = collections.Counter(row[0] for row in rows[setting] if float(row[1].rstrip("x")) > 0)
        assert phases <= set(listed) and max(listed.values()) <= 2, (setting, listed)


def test_engine_options_reach_the_engine(monkeypatch, capsys):
    """The serving commands' engine options (`--draft-fp8`, `--disable-cuda-graph`, ...) configure the profiled
    engine, so that a profile runs the engine `bench-eagle` timed."""
    built = []
    real = profile.warm_engine

    def recording(*args, **options):
        built.append(options)
        return real(*args, **options)

    monkeypatch.setattr(profile, "warm_engine", recording)
    profile.main(["--arch", "tiny", "--trees", "3,2,4", "--input-len", "30", "--new-tokens", "6", "--draft-fp8",
                  "--disable-cuda-graph"])
    assert built and all(o["draft_fp8"] and not o["cuda_graphs"] and o["profile"] for o in built)
    assert "== tiny 3,2,4:" in capsys.readouterr().out


def test_draft_vocab_sizes_the_profiled_head(monkeypatch, capsys):
    """--draft-vocab profiles the head bench-eagle times with the same flag (its draft vocabulary, its lm_head's
    rows); at most 0 is a usage error naming it."""
    heads = []
    real = profile.random_head
    monkeypatch.setattr(profile, "random_head", lambda target, vocab: heads.append(real(target, vocab)) or heads[-1])
    profile.main(["--arch", "tiny", "--trees", "3,2,4", "--input-len", "30", "--new-tokens", "6", "--draft-vocab", "40",
                  "--device", "cpu"])
    assert [h.draft_vocab_size for h in heads] == [40] and heads[0].lm_head.weight.shape[0] == 40
    assert "== tiny 3,2,4:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        profile.main(["--arch", "tiny", "--draft-vocab", "0", "--device", "cpu"])
    assert "--draft-vocab must be at least 1, got 0" in capsys.readouterr().err


def test_sampled_verification_is_counted():
    """At a temperature the verify phase holds the sampled walk's work too: more operators than greedy's, among them
    the draw of the bonus token (`searchsorted`)."""
    target = random_target("tiny", torch.float32, "cpu")
    head = random_head(target)
    prompt, shape = list(range(40)), TreeShape(3, 2, 4)
    greedy = profile.profile_setting(target, head, shape, prompt, 8)
    sampled = profile.profile_setting(target, head, shape, prompt, 8, SamplingParams(temperature=0.8, top_p=0.9))
    assert sampled["verify"].launches > greedy["verify"].launches
    assert "aten::searchsorted" in {k.name for k in sampled["verify"].kernels}



def kernel(name, start, end):
    """A device event as `idle_time` and `per_step` read it."""
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_idle_time_counts_the_gaps_between_overlapping_kernels():
    """b starts inside a and c inside b (programmatic dependent launch): the gap before d follows b, which ended
    last, not c, which started last; the 2 µs gap before e is idle time but below the threshold. Gaps between the
    same two kernels add up."""
    idle = idle_time([kernel("d", 40, 44), kernel("a", 0, 10), kernel("b", 8, 30), kernel("c", 12, 20),
                      kernel("e", 46, 50), kernel("f", 60, 62)], min_gap_us=3)
    assert (idle.span, idle.busy) == (62, 30 + 4 + 4 + 2)
    assert idle.gaps == [("b", "d", 1, 10), ("e", "f", 1, 10)]
    repeated = idle_time([kernel("x", 0, 1), kernel("y", 5, 6), kernel("x", 10, 11), kernel("y", 15, 16)])
    assert repeated.gaps == [("x", "y", 2, 8), ("y", "x", 1, 4)]
    assert idle_time([]).span == 0


def test_overlapping_kernels_are_charged_what_they_add_to_the_end():
    """b starts inside a (launched early, it waits on a) and c inside b: a is charged its 10 µs, b the 20 after a's
    end, c nothing; d, after a gap, its own 4. The charges add up to the busy time; a kind's own times do not."""
    work = [kernel("d", 40, 44), kernel("a", 0, 10), kernel("b", 8, 30), kernel("c", 12, 20), kernel("d", 50, 51)]
    kinds = per_step(work, steps=2)
    assert kinds == [KernelKind("b", 0.5, 11, 10), KernelKind("a", 0.5, 5, 5), KernelKind("d", 1, 2.5, 2.5),
                     KernelKind("c", 0.5, 4, 0)]
    assert 2 * sum(k.charged_us for k in kinds) == idle_time(work).busy


@pytest.mark.parametrize("args, words", [
    (["--new-tokens", "1"], "need --input-len >= 1, --new-tokens >= 2 and --top >= 1, got 1024, 1, 12"),
    (["--input-len", "0"], "got 0, 48, 12"),
    (["--input-len", "4090"], "--input-len 4090 and --new-tokens 48, with the trees' drafts, pass tiny's context of "
                              "4096 tokens"),
    (["--disable-overlap"], "syncs); --idle overlaps them: --disable-overlap would be ignored"),
    (["--attention", "flashinfer"], "--attention flashinfer: the flashinfer attention backend needs a CUDA device"),
])
def test_sizes_it_cannot_profile_are_usage_errors(args, words, capsys, monkeypatch):
    monkeypatch.setattr(profile, "random_target", lambda *args: pytest.fail("built a model"))
    with pytest.raises(SystemExit) as stopped:
        profile.main(["--arch", "tiny", "--device", "cpu", *args])
    assert stopped.value.code == 2 and words in capsys.readouterr().err


def test_idle_needs_cuda(capsys):
    with pytest.raises(SystemExit) as stopped:
        profile.main(["--arch", "tiny", "--idle", "--device", "cpu"])
    assert stopped.value.code == 2 and "--idle measures the GPU's idle time: it needs a CUDA device, not 'cpu'" in (
        capsys.readouterr().err)


@pytest.mark.gpu
def test_idle_on_cuda():
    """The overlapped decode steps of a tiny model on the GPU: its kernels leave the GPU idle part of each step (a
    tiny model's step is bound by the host), never more than the span."""
    target = random_target("tiny", torch.float32, "cuda")
    idle, steps = profile.idle_setting(target, random_head(target), TreeShape(3, 2, 4), list(range(40)), 12)
    assert 0 < steps <= 12 and 0 < idle.busy < idle.span
    assert idle.gaps and all(count >= 1 and us > 3 * count for _, _, count, us in idle.gaps)
