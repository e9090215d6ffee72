"""Training-time test: the unrolled attention is causal at step 0, every step computes what the server's
sequential drafting computes, the loss matches a hand-written reference, masking and padding are exact,
gradients reach only the head, and the acceptance length follows from the per-step accuracies."""

import math

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from eyas.common.attention import CausalAttention, MaskedAttention, causal_mask
from eyas.common.eagle3 import Eagle3Config, Eagle3Head
from eyas.common.hot_vocab import HotVocab
from eyas.common.layers import use_kernels
from eyas.common.target import TargetOutput
from eyas.train.ttt import (
    TTTAttention,
    acceptance_length,
    compiled_kernels,
    soft_cross_entropy,
    training_kernels,
    ttt_loss,
    ttt_mask_mod,
    unroll,
)

H, HEADS, KV, D, FFN, V, DV, HT = 32, 4, 2, 8, 64, 50, 20, 24


def make_head(head_dim=D):
    torch.manual_seed(0)
    cfg = Eagle3Config(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=head_dim, intermediate_size=FFN,
        rms_norm_eps=1e-6, max_position_embeddings=1024, vocab_size=V, draft_vocab_size=DV, target_hidden_size=HT,
    )
    head = Eagle3Head(cfg)
    with torch.no_grad():  # non-trivial norm weights, so that every parameter matters
        for name, p in head.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    head.set_hot_vocab(HotVocab(torch.randperm(V)[:DV].sort().values, V))
    return head


@pytest.fixture
def head():
    return make_head()


@pytest.fixture
def embed():
    torch.manual_seed(1)
    return nn.Embedding(V, H)


def make_batch(head, B=2, T=12, seed=2):
    """input_ids, aux, target_logits, loss_mask, attention_mask; most target argmaxes are draftable, some not."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(V, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * HT, generator=g)
    target_logits = 2 * torch.randn(B, T, V, generator=g) + 2 * head.t2d.float()
    loss_mask = (torch.rand(B, T, generator=g) < 0.7).long()
    return input_ids, aux, target_logits, loss_mask, torch.ones(B, T, dtype=torch.long)


def step0(head, embed, input_ids, aux, attn):
    hidden = head.project_target(TargetOutput(hidden=None, aux=aux))
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return head.step(embed(input_ids[:, 1:]), hidden[:, :-1], positions[:, :-1], attn)


@torch.no_grad()
def test_step0_is_causal_attention(head, embed):
    input_ids, aux, *_ = make_batch(head)
    B, T = input_ids.shape
    ttt = step0(head, embed, input_ids, aux, TTTAttention(T - 1))
    torch.testing.assert_close(ttt, step0(head, embed, input_ids, aux, CausalAttention()), rtol=0, atol=1e-6)


@torch.no_grad()
def test_padded_keys_are_never_attended(head, embed):
    """Right padding full of garbage: real positions equal the unpadded row; nothing is NaN."""
    input_ids, aux, *_ = make_batch(head, B=1, T=9)
    ref = step0(head, embed, input_ids, aux, CausalAttention())  # [1, 8, H]
    P = 3
    ids = torch.cat([input_ids, torch.randint(V, (1, P))], 1)
    aux_pad = torch.cat([aux, 100 * torch.randn(1, P, 3 * HT)], 1)
    got = step0(head, embed, ids, aux_pad, TTTAttention(ids.shape[1] - 1))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:, : ref.shape[1]], ref, rtol=0, atol=1e-6)


def test_mask_mod_is_the_documented_mask():
    """ttt_mask_mod, evaluated densely, is the docstring's example (T=3, step 1)."""
    q, kv = torch.arange(3)[:, None], torch.arange(6)[None]
    expected = torch.tensor([[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(ttt_mask_mod(3)(None, None, q, kv), expected)


@torch.no_grad()
def served_chain(head, embed, input_ids, aux, t, steps):
    """Row 0's draft chain after position t, computed the way the server does: step 0 over the prefix 0..t
    with causal attention, then each drafted step as a new token at position t+i that sees the prefix keys and
    the chain so far (a growing explicit mask), fed its predecessor's output and the next true token."""
    prefix_hidden = head.project_target(TargetOutput(hidden=None, aux=aux[:1, : t + 1]))  # [1, t+1, H]
    prefix_embeds = embed(input_ids[:1, 1 : t + 2])  # x_1..x_{t+1}
    prefix_pos = torch.arange(t + 1)
    chain = [head.step(prefix_embeds, prefix_hidden, prefix_pos[None], CausalAttention())[:, -1]]
    for i in range(1, steps):
        n = t + 1 + i
        embeds = torch.cat([prefix_embeds, embed(input_ids[:1, t + 2 : t + 2 + i])], 1)  # chain tokens x_{t+1+j}
        hidden = torch.cat([prefix_hidden, torch.stack(chain, 1)], 1)  # chain step j reads out_{j-1}
        positions = torch.cat([prefix_pos, t + torch.arange(1, i + 1)])
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[: t + 1, : t + 1] = causal_mask(t + 1)
        mask[t + 1 :, : t + 1] = True
        mask[t + 1 :, t + 1 :] = causal_mask(i)
        chain.append(head.step(embeds, hidden, positions[None], MaskedAttention(mask[None]))[:, -1])
    return chain


@pytest.mark.parametrize("t", [0, 3, 6])
@torch.no_grad()
def test_unroll_equals_served_chain(head, embed, t):
    steps = 4
    input_ids, aux, *_ = make_batch(head, T=11)
    outs = unroll(head, embed, input_ids, aux, steps)
    for i, served in enumerate(served_chain(head, embed, input_ids, aux, t, steps)):
        torch.testing.assert_close(outs[i][:1, t], served, rtol=0, atol=1e-5, msg=f"step {i}")


@torch.no_grad()
def reference(head, embed, input_ids, aux, target_logits, loss_mask, attention_mask, steps, decay):
    """Loops over steps, rows and positions; step i at t is labelled by the target at j = t+1+i."""
    outs = unroll(head, embed, input_ids, aux, steps)
    hot = head.hot_vocab.hot_ids.tolist()
    B, T = input_ids.shape
    losses, accs, counts = [], [], []
    for i in range(steps):
        total, count, correct = 0.0, 0, 0
        for b in range(B):
            for t in range(T):
                j = t + 1 + i
                if j + 1 >= T or not (loss_mask[b, j + 1] and attention_mask[b, j + 1] and attention_mask[b, t]):
                    continue  # x_{j+1} is missing, padding or not an assistant token, or t is padding
                target_id = int(target_logits[b, j].argmax())
                if target_id not in hot:
                    continue
                p = target_logits[b, j, hot].softmax(-1)
                logq = head.logits(outs[i][b, t]).log_softmax(-1)
                total += float(-(p * logq).sum())
                count += 1
                correct += hot[int(logq.argmax())] == target_id
        losses.append(total / max(count, 1))
        accs.append(correct / max(count, 1))
        counts.append(count)
    return sum(decay**i * loss for i, loss in enumerate(losses)), losses, accs, counts


@pytest.mark.parametrize("steps", [2, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_loss_matches_reference(head, embed, steps, padded):
    batch = make_batch(head)
    if padded:  # row 0 right-padded by 2, row 1 by 3
        batch[4][0, -2:] = 0
        batch[4][1, -3:] = 0
    out = ttt_loss(head, embed, *batch, steps=steps)
    loss, losses, accs, counts = reference(head, embed, *batch, steps=steps, decay=0.8)
    assert out.per_step_count.tolist() == counts and min(counts) > 2
    torch.testing.assert_close(out.per_step_loss, torch.tensor(losses), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.per_step_acc, torch.tensor(accs), rtol=0, atol=1e-6)
    assert abs(out.loss.item() - loss) < 1e-5


def test_step_weights(head, embed):
    batch = make_batch(head)
    for decay in (0.8, 0.5):
        out = ttt_loss(head, embed, *batch, steps=3, decay=decay)
        assert abs(out.loss.item() - reference(head, embed, *batch, steps=3, decay=decay)[0]) < 1e-5


def test_uncounted_labels_contribute_nothing(head, embed):
    input_ids, aux, target_logits, loss_mask, attention_mask = make_batch(head)
    base = ttt_loss(head, embed, input_ids, aux, target_logits, loss_mask, attention_mask, steps=3)

    # Labels whose predicted token is not an assistant token: any target logits there leave the loss as is.
    not_assistant = torch.nn.functional.pad(loss_mask[:, 1:] == 0, (0, 1), value=True)  # [B, T]
    noisy = torch.where(not_assistant[..., None], 10 * torch.randn_like(target_logits), target_logits)
    out = ttt_loss(head, embed, input_ids, aux, noisy, loss_mask, attention_mask, steps=3)
    torch.testing.assert_close(out.loss, base.loss, rtol=0, atol=1e-6)

    # A label whose target argmax leaves the draft vocab drops out of every step; its draft columns then don't matter.
    b, j = 0, 5
    assert loss_mask[b, j + 1] == 1 and head.t2d[target_logits[b, j].argmax()]
    outside = int((~head.t2d).nonzero()[0])
    moved = target_logits.clone()
    moved[b, j, outside] = 100.0
    out = ttt_loss(head, embed, input_ids, aux, moved, loss_mask, attention_mask, steps=3)
    assert (base.per_step_count - out.per_step_count).tolist() == [1, 1, 1]  # j labels step i at t = j-1-i
    moved[b, j, head.t2d] = 10 * torch.randn(DV)
    again = ttt_loss(head, embed, input_ids, aux, moved, loss_mask, attention_mask, steps=3)
    torch.testing.assert_close(again.loss, out.loss, rtol=0, atol=1e-6)


def test_padding_changes_nothing(head, embed):
    """A whole padding row, and padding at the end of rows, filled with garbage, leave every output as is."""
    input_ids, aux, target_logits, loss_mask, attention_mask = make_batch(head)
    base = ttt_loss(head, embed, input_ids, aux, target_logits, loss_mask, attention_mask, steps=3)

    def garbage(x, dim, n):
        shape = list(x.shape)
        shape[dim] = n
        if x.dtype == torch.long:
            return torch.randint(V, shape)
        return 100 * torch.randn(shape)

    B, T = input_ids.shape
    # A padding row: loss_mask and attention_mask 0.
    row = [torch.cat([x, garbage(x, 0, 1)]) for x in (input_ids, aux, target_logits)]
    zeros = torch.zeros(1, T, dtype=torch.long)
    out = ttt_loss(head, embed, *row, torch.cat([loss_mask, zeros]), torch.cat([attention_mask, zeros]), steps=3)
    for field in ("loss", "per_step_loss", "per_step_acc", "per_step_count"):
        torch.testing.assert_close(getattr(out, field), getattr(base, field), rtol=0, atol=1e-6)

    # Padding at the end (3) of every row.
    def pad(x, fill=None):
        return torch.cat([x, garbage(x, 1, 3) if fill is None else torch.full((B, 3), fill)], 1)

    out = ttt_loss(
        head, embed, pad(input_ids), pad(aux), pad(target_logits), pad(loss_mask, 1), pad(attention_mask, 0), steps=3
    )
    torch.testing.assert_close(out.per_step_count, base.per_step_count)
    torch.testing.assert_close(out.per_step_loss, base.per_step_loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss, base.loss, rtol=0, atol=1e-5)


def test_gradients_reach_only_the_head(head, embed):
    input_ids, aux, target_logits, loss_mask, attention_mask = make_batch(head)
    aux.requires_grad_(True)
    target_logits.requires_grad_(True)
    ttt_loss(head, embed, input_ids, aux, target_logits, loss_mask, attention_mask, steps=3).loss.backward()
    for name, p in head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert embed.weight.grad is None and aux.grad is None and target_logits.grad is None


def test_gradients_flow_through_the_chain(head, embed):
    """Step i's output depends on step i-1's output (the fed-back hidden state is not detached)."""
    input_ids, aux, _, _, attention_mask = make_batch(head)
    outs = unroll(head, embed, input_ids, aux, steps=3)
    (grad,) = torch.autograd.grad(head.logits(outs[2]).sum(), outs[1])
    assert grad.abs().sum() > 0


def test_soft_cross_entropy_is_cross_entropy_against_soft_labels():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 5, DV, generator=g)).requires_grad_(True)
    label_logits = 2 * torch.randn(4, 5, DV, generator=g)
    p = label_logits.softmax(-1)
    got, top = soft_cross_entropy(logits, label_logits, label_logits.logsumexp(-1))
    expected = -(p * logits.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(top, logits.argmax(-1))
    (grad,) = torch.autograd.grad(got.sum(), logits)
    torch.testing.assert_close(grad, logits.softmax(-1) - p, rtol=0, atol=1e-6)  # the soft-label CE gradient


@pytest.mark.gpu
@pytest.mark.parametrize("T", [300, 512])
def test_cuda_loss_equals_cpu(embed, T):
    """On CUDA the unrolled attention is FlexAttention (block-sparse, compiled; head_dim 16, its least), the head's
    kernels compiled and the loss Triton's: loss, metrics and every gradient agree with the CPU path (dense-mask SDPA,
    eager), at lengths off the 128-token blocks."""
    head = make_head(head_dim=16)
    batch = make_batch(head, T=T)
    batch[4][1, -37:] = 0  # row 1 right-padded

    def run(device):
        model, emb = (m.to(device) for m in (head, embed))
        use_kernels(model, training_kernels(torch.device(device)))  # as the trainer: on CUDA compiled
        model.zero_grad()
        out = ttt_loss(model, emb, *(x.to(device) for x in batch), steps=4)
        out.loss.backward()
        # Copies: the next run's `.to` moves the module's grads in place.
        return out, {name: p.grad.clone().cpu() for name, p in model.named_parameters()}

    cpu, cpu_grads = run("cpu")
    cuda, cuda_grads = run("cuda")
    for field in ("loss", "per_step_loss", "per_step_acc", "per_step_count"):
        torch.testing.assert_close(getattr(cuda, field).cpu(), getattr(cpu, field), rtol=1e-4, atol=1e-4)
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(cuda_grads[name], grad, rtol=1e-3, atol=1e-4, msg=name)


def test_compiled_kernels_keep_a_graph_for_every_variant_of_training_and_evaluation(embed):
    """The head's linears (fc, o, down, lm_head) on batches of one row and of two, with and without gradients, are
    16 variants of `Kernels.linear`: each keeps a compiled graph (past dynamo's default limit of 8, a further
    variant would run eagerly). Compiled with dynamo's eager backend: the same graphs, without inductor's code."""
    torch._dynamo.reset()
    counters.clear()
    head = make_head()
    use_kernels(head, compiled_kernels("eager"))
    for grad in (True, False):
        for B in (2, 1):
            with torch.set_grad_enabled(grad):
                out = ttt_loss(head, embed, *make_batch(head, B=B), steps=3)
            if grad:
                out.loss.backward()
    # The other four kernels keep 4 graphs each (rows, gradients), so more than 24 in all means more than 8 linears.
    assert counters["stats"]["unique_graphs"] == counters["frames"]["total"] == counters["frames"]["ok"] > 4 * 4 + 8


def test_acceptance_length():
    assert float(acceptance_length(torch.tensor([0.8, 0.5, 0.25]))) == pytest.approx(2.3)
    assert float(acceptance_length(torch.ones(7))) == 8
    assert float(acceptance_length(torch.zeros(7))) == 1
    assert float(acceptance_length(torch.tensor([0.0, 1.0, 1.0]))) == 1  # a chain stops at its first miss


def test_output_tau_is_the_chain_s_from_the_reference_accuracies(head, embed):
    """τ = 1 + Σ_k Π_{i<=k} acc_i: a chain accepts position k only where it accepted every one before."""
    batch = make_batch(head)
    out = ttt_loss(head, embed, *batch, steps=4)
    accs = reference(head, embed, *batch, steps=4, decay=0.8)[2]
    assert float(out.tau) == pytest.approx(1 + sum(math.prod(accs[: k + 1]) for k in range(4)), abs=1e-5)
