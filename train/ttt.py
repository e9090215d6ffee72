"""Training-time test (TTT): the EAGLE-3 head unrolled k steps over whole sequences, and its loss.

    out = ttt_loss(head, target.embed_tokens, input_ids, aux, target_logits, loss_mask, attention_mask)
    out.loss.backward()   # out.per_step_acc, out.tau: what serving should see

Alignment for one row x_0..x_{T-1}; p(j) = softmax(target logits at j), the target's distribution of x_{j+1}:

    step i at position t | hidden input  | token     | rotary | attends to                            | label
    0                    | fc(aux_t)     | x_{t+1}   | t      | step-0 keys at 0..t                   | p(t+1)
    1                    | out_0[t]      | x_{t+2}   | t+1    | step-0 keys at 0..t, step-1 key at t  | p(t+2)
    i                    | out_{i-1}[t]  | x_{t+1+i} | t+i    | step-0 keys at 0..t, steps 1..i at t  | p(t+1+i)

This is what the server computes: after a verification it holds aux_t and the bonus token x_{t+1}; draft step 0
reads them at position t, and the i-th drafted token (which, when accepted, is x_{t+1+i}) is fed at position t+i,
attending to the real prefix and the chain drafted so far. Training teacher-forces the true tokens along the chain
but feeds the head its own hidden outputs, exactly as serving does. A label counts when the token it predicts,
x_{t+2+i}, exists, is an assistant token (loss_mask) and the target's argmax at t+1+i is in the draft vocabulary,
and position t is not padding. Padding (attention_mask 0) may only end a row (right padding, as `Batches` collates):
then a real t and a real x_{t+2+i} imply that every position between them is real, and the attention needs no
per-row mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from eyas.common.attention import AttentionMetadata, sdpa
from eyas.common.eagle3 import Eagle3Head
from eyas.common.layers import Kernels
from eyas.common.target import TargetOutput


def ttt_mask_mod(T: int):
    """The unrolled attention's mask as a FlexAttention `mask_mod(b, h, q, kv)` (True = may attend), over the
    concatenated keys [k_0 ‖ … ‖ k_i]: key kv is step kv // T's key at position kv % T. Step 0's keys are causal;
    a later step's key is seen only by the query at its own position (each position's own chain). Example, T=3,
    step 1 (row = query position, columns = k_0 at 0,1,2 then k_1 at 0,1,2):

        1 0 0 | 1 0 0
        1 1 0 | 0 1 0
        1 1 1 | 0 0 1
    """
    def mask_mod(b, h, q, kv):
        return torch.where(kv < T, kv <= q, kv % T == q)
    return mask_mod


@functools.lru_cache(maxsize=64)
def _block_mask(T: int, S: int, device: torch.device) -> BlockMask:
    """The mask's block-sparse form for T queries and S = T·(i+1) keys; rows are right-padded, so one mask serves
    every batch of that length (8 lengths × 7 steps with the recipes' padding to multiples of 256)."""
    return create_block_mask(ttt_mask_mod(T), None, None, T, S, device=device)


def training_kernels(device: torch.device) -> Kernels:
    """The head's elementwise kernels in training on `device` (`use_kernels`): on CUDA compiled, forward and backward,
    for eager each RMSNorm, rotary or SiLU·mul is a chain of small kernels over [B, T, H], `steps` times a step (a
    SmolLM2-sized head's step at 16 rows of 2,048 tokens: 12% shorter, docs/perf.md); elsewhere the torch
    references."""
    return _COMPILED_KERNELS if device.type == "cuda" else Kernels()


def compiled_kernels(backend: str = "inductor") -> Kernels:
    """`Kernels` whose functions are each compiled once for all lengths (tests compile them with `backend` "eager")."""
    return Kernels(**{f.name: torch.compile(getattr(Kernels(), f.name), dynamic=True, backend=backend)
                      for f in dataclasses.fields(Kernels)})


_COMPILED_KERNELS = compiled_kernels()
# A compiled function keeps a graph per variant of its calls. `Kernels.linear` serves the head's fc, o, down and
# lm_head (each its own K and flags), on batches of one row or more (dynamo specializes a size of 1), in training and
# in evaluation (grad mode): 16 variants on the CPU (the test), past dynamo's default of 8 graphs a function, after
# which each new variant runs eagerly for the rest of the run. Every SmolLM2 leg on an H100 hit that limit within its
# first 13 steps (docs/perf.md, fifty-sixth entry). On one H100 over the same batches (steps 100-450) a median step took
# 92.1 ms with this limit, 92.5 at the default and 98.5 with `linear` left eager (fifty-eighth entry).
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)


# Compiled once for all lengths; the FlexAttention kernel skips the fully masked blocks, so step i costs about a
# causal attention plus i·T diagonal entries instead of (i+1)·T² scores.
_flex_attention = torch.compile(flex_attention, dynamic=True)


class TTTAttention(AttentionMetadata):
    """Attention of the unrolled head, one object per unroll; `attend` is called once per step, in order.

    It keeps each step's keys/values and attends over their concatenation [k_0 ‖ k_1 ‖ … ‖ k_i]
    ([B, T·(i+1), Hkv, D]) under `ttt_mask_mod`. On CUDA that is one FlexAttention call per step, whose blocks
    that the mask empties cost nothing. Elsewhere (FlexAttention has no CPU backward; on CUDA, none below head_dim
    16) it is SDPA under the same mask made dense, [T, T·(i+1)] bools, which does (i+1)·T² score work.

    Padding: rows must be right-padded (as `Batches` collates them). A real query at t sees only keys at 0..t,
    all real; a padded query sees whatever precedes it (itself at least: no empty softmax row, no NaN) and its
    output is never counted.
    """

    def __init__(self, T: int):
        self.T = T
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.keys.append(k)
        self.values.append(v)
        keys, values = torch.cat(self.keys, dim=1), torch.cat(self.values, dim=1)  # [B, S = T·(i+1), Hkv, D]
        T, S = self.T, keys.shape[1]
        if q.is_cuda and q.shape[-1] >= 16:  # FlexAttention's kernels need head_dim >= 16
            out = _flex_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                  block_mask=_block_mask(T, S, q.device), enable_gqa=q.shape[2] != k.shape[2])
            return out.transpose(1, 2)
        mask = ttt_mask_mod(T)(None, None, torch.arange(T)[:, None], torch.arange(S)[None])  # [T, S]
        return sdpa(q, keys, values, mask=mask[None].to(q.device))


def unroll(
    head: Eagle3Head,
    embed: nn.Module | Tensor,
    input_ids: Tensor,
    aux: Tensor,
    steps: int,
) -> list[Tensor]:
    """The head's outputs of steps 0..steps-1, each [B, T, H] (pre-norm), aligned as in the module docstring.

    embed: the target's embedding, an `nn.Embedding` or its weight [V, H]; frozen here (no gradient reaches it).
    aux [B, T, 3·Ht]: the target's captured streams (detached: the target is frozen).
    Rotary positions are the row indices t (+ i). Rows are right-padded (`TTTAttention`).
    """
    B, T = input_ids.shape
    hidden = head.project_target(TargetOutput(hidden=None, aux=aux.detach()))  # [B, T, H]
    with torch.no_grad():
        embeds = embed(input_ids) if isinstance(embed, nn.Module) else F.embedding(input_ids, embed)
    # Step i at position t reads x_{t+1+i}: pad `steps` zero rows at the end and slice; positions that read
    # past the sequence are never counted (their labels do not exist), and they only attend, never are attended
    # by, earlier positions.
    embeds = F.pad(embeds.to(hidden.dtype), (0, 0, 0, steps))  # [B, T + steps, H]
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    attn = TTTAttention(T)
    outs = []
    for i in range(steps):
        hidden = head.step(embeds[:, 1 + i : 1 + i + T], hidden, positions + i, attn)
        outs.append(hidden)
    return outs


def acceptance_length(acc: Tensor) -> Tensor:
    """Expected tokens per target pass of a greedy chain draft, from per-step accuracies acc [k]:
    τ = 1 + Σ_i Π_{j≤i} acc_j (the 1 is the bonus token every verification yields).

    This reads acc_i as conditional: the probability that step i is right given steps 0..i-1 were accepted,
    for only then does serving reach step i, with exactly the inputs TTT feeds (the true tokens along the
    chain). The unrolled acc_i is measured over all counted positions, including those where an earlier step
    was wrong; errors are positively correlated in practice, so this underestimates the conditional accuracy
    a little, and τ with it. Example: acc [0.8, 0.5, 0.25] -> 1 + 0.8 + 0.4 + 0.1 = 2.3.
    """
    return 1 + acc.cumprod(0).sum()


def soft_cross_entropy(logits: Tensor, label_logits: Tensor, label_lse: Tensor) -> tuple[Tensor, Tensor]:
    """-Σ_v p_v · log_softmax(logits)_v = logsumexp(logits) - Σ_v p_v · logits_v, for the soft labels p =
    softmax(label_logits) = exp(label_logits - label_lse), in fp32; and the logits' argmax. logits, label_logits
    [..., V] (any float dtype), label_lse [...] fp32 -> ([...] fp32, [...] int64). On CUDA the same in two Triton
    passes over the logits (`soft_ce`)."""
    top = logits.detach().argmax(-1)
    logits = logits.float()
    p = torch.exp(label_logits.float() - label_lse.unsqueeze(-1))
    return torch.logsumexp(logits, -1) - (p * logits).sum(-1), top


def _soft_cross_entropy_for(device: torch.device):
    if device.type != "cuda":
        return soft_cross_entropy
    from .soft_ce import soft_cross_entropy_kernel  # triton, which CUDA builds of torch bring

    return soft_cross_entropy_kernel


class TTTOutput(NamedTuple):  # a tuple, whose tensors DeepSpeed's ZeRO-3 hooks can find (not so a dataclass)
    loss: Tensor  # scalar, Σ_i decay^i · per_step_loss[i]; the only field that carries gradient
    per_step_loss: Tensor  # [k] soft-label cross-entropy, mean over the counted positions of step i
    per_step_acc: Tensor  # [k] draft argmax == target argmax, fraction of the counted positions of step i
    per_step_count: Tensor  # [k] int64: counted positions of step i (the denominators; to aggregate over batches)
    tau: Tensor  # scalar: acceptance_length(per_step_acc)


def ttt_loss(
    head: Eagle3Head,
    embed: nn.Module | Tensor,
    input_ids: Tensor,
    aux: Tensor,
    target_logits: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor | None = None,
    steps: int = 7,
    decay: float = 0.8,
) -> TTTOutput:
    """Unrolls the head `steps` steps and returns the decayed soft-label loss and per-step metrics.

    input_ids, loss_mask, attention_mask [B, T] (1 = assistant token / real token; attention_mask None: no
    padding); aux [B, T, 3·Ht]; target_logits [B, T, V] over the full target vocab, at every position.

    Normalisation: per_step_loss[i] = Σ_{b,t} w_i[b,t]·CE_i[b,t] / max(Σ_{b,t} w_i[b,t], 1), w_i the 0/1 count
    mask of step i (see the module docstring). It is a mean over counted tokens of the whole batch, so padding
    (positions or whole rows) changes neither numerator nor denominator; rows weigh by their counted tokens.
    Under data parallelism each rank normalises by its own count; per_step_count allows a global reweighting.

    Memory: target_logits [B, T, V] may be large (V = 152k: 0.6 GB per 2048-token row in bf16); only its argmax
    needs the full vocab, the labels use the draft columns.
    """
    T = input_ids.shape[1]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    hot = head.hot_vocab
    with torch.no_grad():
        target_ids = target_logits.argmax(-1)  # [B, T]
        # The labels: softmax over the draft columns only = the target distribution renormalised over the draft vocab,
        # formed by the loss from these columns and their logsumexp (taken a row at a time: no fp32 [B, T, V] copy).
        label_logits = hot.restrict_logits(target_logits)  # [B, T, draft_vocab]
        label_lse = torch.stack([row.float().logsumexp(-1) for row in label_logits])  # [B, T]
        # counted[b, j]: p(j) is a label: x_{j+1} exists, is a real assistant token, and the argmax is draftable.
        valid = attention_mask.bool()  # [B, T]
        predicts_assistant = F.pad((loss_mask.bool() & valid)[:, 1:], (0, 1))  # [B, T]
        counted = predicts_assistant & hot.t2d[target_ids]  # [B, T]

    outs = unroll(head, embed, input_ids, aux, steps)
    soft_ce = _soft_cross_entropy_for(label_logits.device)
    losses, accs, counts = [], [], []
    for i, out in enumerate(outs):
        # Step i at positions t = 0..T-2-i is labelled by p(t+1+i); later positions have no label.
        n = max(T - 1 - i, 0)
        logits = head.logits(out[:, :n])  # [B, n, draft_vocab]
        w = counted[:, 1 + i :]  # [B, n]; a real x_{t+2+i} implies a real t (right padding)
        ce, top = soft_ce(logits, label_logits[:, 1 + i :], label_lse[:, 1 + i :])
        count = w.sum()
        losses.append((ce * w).sum() / count.clamp(min=1))
        with torch.no_grad():
            correct = (hot.to_target(top) == target_ids[:, 1 + i :]) & w
            accs.append(correct.sum() / count.clamp(min=1))
        counts.append(count)

    per_step_loss = torch.stack(losses)  # [k]
    weights = decay ** torch.arange(steps, device=per_step_loss.device, dtype=per_step_loss.dtype)
    per_step_acc = torch.stack(accs)
    return TTTOutput(
        loss=(weights * per_step_loss).sum(),
        per_step_loss=per_step_loss.detach(),
        per_step_acc=per_step_acc,
        per_step_count=torch.stack(counts),
        tau=acceptance_length(per_step_acc),
    )
