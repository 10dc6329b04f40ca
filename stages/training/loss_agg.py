"""How per-token losses become the loss of one optimizer step: verl's ``loss_agg_mode``, exactly.

``loss_agg`` (`sft.loss_agg`, `ppo.loss_agg`) names the aggregate over the whole batch of a step
(every micro-batch of every rank), with verl's names:

* ``token-mean``: the sum of the token losses over the batch's token count: every token weighs the
  same, so a long sequence weighs more than a short one.
* ``seq-mean-token-mean``: the mean over sequences of each sequence's token mean: every sequence
  weighs the same. verl's ``token-mean`` taken per micro-batch of one sequence (SPA's runs: micro
  batch 1) and averaged over the micro-batches and ranks is exactly this.
* ``seq-mean-token-sum``: the mean over sequences of each sequence's token sum.

A micro-batch contributes ``sum(weights * losses)`` (`token_weights`), with the normaliser of the
whole batch (`batch_normalizer`): summed over the micro-batches and ranks (the engine undoes
DeepSpeed's own 1/world and 1/accumulation scaling), that is the aggregate of the whole batch,
whatever the micro-batching. The layout of a micro-batch does not matter: only each token's loss
and the sequence it belongs to, every token of a sequence lying in one micro-batch.
"""

from __future__ import annotations

from typing import get_args

import torch

from stages.common.config import LossAgg

LOSS_AGGS = get_args(LossAgg)


def batch_normalizer(mode: str, tokens: int, sequences: int) -> int:
    """What the whole batch's aggregate divides by: its token count (token-mean) or its sequence count."""
    if mode not in LOSS_AGGS:
        raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(LOSS_AGGS)}")
    return tokens if mode == "token-mean" else sequences


def token_weights(sequence_of: torch.Tensor, mode: str, normalizer: int) -> torch.Tensor:
    """The weight of each token's loss in the batch's aggregate: ``sequence_of`` [N] says which
    sequence of the micro-batch each token belongs to (0, 1, ...; every token of that sequence is
    among the N), ``normalizer`` is `batch_normalizer`'s for the whole batch."""
    weights = torch.full(sequence_of.shape, 1.0 / normalizer, device=sequence_of.device)
    if mode == "seq-mean-token-mean":
        weights = weights / torch.bincount(sequence_of)[sequence_of]
    return weights


def sequence_index(counts: list[int], device: object = None) -> torch.Tensor:
    """``sequence_of`` for a micro-batch whose sequences have ``counts`` tokens, in that order."""
    return torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))
