"""Draft heads for the engine's tests: random ones, and ones fitted to the target's own continuations so that drafts
are accepted (a random head's all were, in the engine tests that counted them: 0 of 39 steps), for the paths a
rejected draft never takes (multi-token acceptance, KV moves, draft extension)."""

import torch
from torch import Tensor

from eyas.common.attention import CausalAttention
from eyas.common.eagle3 import Eagle3Config, Eagle3Head
from eyas.common.hot_vocab import HotVocab
from eyas.common.target import TargetModel
from eyas.train.ttt import ttt_loss


def random_head(target: TargetModel, draft_vocab: int = 200, seed: int = 0, frequent: Tensor | None = None
                ) -> Eagle3Head:
    """A head of random weights (`seed`) whose draft vocabulary is `draft_vocab` random tokens, or the most frequent
    of the token ids `frequent`, ties broken at random."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab)).eval()
    vocab = target.config.vocab_size
    counts = torch.rand(vocab)
    if frequent is not None:
        counts += torch.bincount(frequent, minlength=vocab)
    head.set_hot_vocab(HotVocab.from_counts(counts, draft_vocab))
    return head


def fitted_head(target: TargetModel, sequences: list[list[int]], prompt_lens: list[int], draft_vocab: int,
                steps: int = 100, seed: int = 0) -> tuple[Eagle3Head, float]:
    """A head trained `steps` steps with the TTT loss (4 steps unrolled) on `sequences`, prompts of `prompt_lens`
    tokens each followed by the target's own greedy continuation (the loss's tokens), its draft vocabulary the
    `draft_vocab` tokens most frequent in them. Returns (head, the TTT-implied acceptance length on them)."""
    length = max(map(len, sequences))
    ids = torch.zeros(len(sequences), length, dtype=torch.long)  # [B, T], padded on the right
    valid, continuation = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, (sequence, prompt_len) in enumerate(zip(sequences, prompt_lens, strict=True)):
        ids[row, :len(sequence)] = torch.tensor(sequence)
        valid[row, :len(sequence)] = 1
        continuation[row, prompt_len:len(sequence)] = 1
    with torch.no_grad():
        out = target(ids, torch.arange(length).expand(len(ids), -1), CausalAttention(),
                     aux_layers=target.config.default_aux_layers)
        logits = target.logits(out.hidden)
    head = random_head(target, draft_vocab, seed, frequent=ids[valid.bool()])
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = ttt_loss(head, target.embed_tokens, ids, out.aux, logits, continuation, valid, steps=4).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        tau = ttt_loss(head, target.embed_tokens, ids, out.aux, logits, continuation, valid, steps=4).tau.item()
    return head.eval(), tau
