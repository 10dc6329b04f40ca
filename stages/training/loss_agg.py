"""How per-token losses become the loss of one optimizer step: verl's ``loss_agg_mode``, exactly.

``loss_agg`` (`sft.loss_agg`, `ppo.loss_agg`) names the aggregate over the whole batch of a step
(every micro-batch of every rank), with verl's names. A sequence is an SFT row (a trajectory or a
turn, per `clean.unit`) or a PPO episode; its tokens are those that carry a loss.

* ``token-mean``: the sum of the token losses over the batch's token count: every token weighs the
  same, so a long sequence weighs more than a short one.
* ``seq-mean-token-mean``: the mean over sequences of each sequence's token mean: every sequence
  weighs the same. verl's ``token-mean`` taken per micro-batch of one sequence (SPA's runs: micro
  batch 1, in SFT and PPO) and averaged over the micro-batches and ranks is exactly this.
* ``seq-mean-token-sum``: the mean over sequences of each sequence's token sum.
* ``seq-mean-token-sum-norm`` (Dr. GRPO): the mean over sequences of each sequence's token sum
  divided by a constant, the stage's token budget (`sequence_budget`): a long sequence weighs more, as
  in token-mean, but the weight of a token does not shrink when the batch holds more tokens. verl
  divides each micro-batch's sum of sequence token sums by its ``loss_scale_factor`` (by default
  the padded response length) and scales micro-batches by 1 / their count, so with micro-batches
  of one sequence it computes exactly this; with more sequences a micro-batch its value grows with
  the micro-batch size, which spa, whose aggregate never depends on the micro-batching, does not
  copy.

A micro-batch contributes ``sum(weights * losses)`` (`token_weights`), with the normaliser of the
whole batch (`batch_normalizer`): summed over the micro-batches and ranks (the engine undoes
DeepSpeed's own 1/world and 1/accumulation scaling), that is the aggregate of the whole batch,
whatever the micro-batching. The layout of a micro-batch does not matter: only each token's loss
and the sequence it belongs to, every token of a sequence lying in one micro-batch.
"""

from __future__ import annotations

from typing import get_args

import torch

from stages.common.config import LossAgg, SPAConfig

LOSS_AGGS = get_args(LossAgg)


def sequence_budget(config: SPAConfig, stage: str) -> int:
    """seq-mean-token-sum-norm's constant: the most tokens a sequence of `stage` ("sft" or "ppo")
    may have, fixed by the config for the whole run. SFT: `sft.max_length` (a row's tokens). PPO:
    `rollout.max_turns` x `rollout.max_new_tokens` (the tokens an episode's turns may generate)."""
    if stage == "sft":
        return config.sft.max_length
    return config.rollout.max_turns * config.rollout.max_new_tokens


def batch_normalizer(mode: str, tokens: int, sequences: int, budget: int) -> int:
    """What the whole batch's aggregate divides by: its token count (token-mean), its sequence count,
    or (seq-mean-token-sum-norm) its sequence count times the token `budget` (`sequence_budget`)."""
    if mode not in LOSS_AGGS:
        raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(LOSS_AGGS)}")
    if mode == "token-mean":
        return tokens
    return sequences * budget if mode == "seq-mean-token-sum-norm" else sequences


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
