"""The PPO mathematics of `spa ppo`, as pure torch functions on padded ``[batch, time]`` tensors.

Conventions shared by every function:

* ``mask`` is the loss mask: 1 on the tokens that are trained (the model's own sampled tokens, or
  every token after the system prompt, see ``ppo.loss_mask``), 0 elsewhere (prompt, environment
  text, padding). Masked-out positions of every output are 0.
* Only positions where the mask is 1 are *steps* of the decision process. The tokens between two
  steps (an environment reply between two turns) are skipped, so the GAE recursion links each
  model token to the next model token, across turns.
* Losses are aggregated with per-token ``weights`` (`stages.training.loss_agg`: the weights of
  ``ppo.loss_agg`` with the normaliser of the whole mini-batch, so that gradient accumulation over
  micro-batches gives exactly the mini-batch's aggregate); without them, as a token mean over the
  mask.
"""

from __future__ import annotations

import math

import torch

from stages.common.errors import UserError

# The log-ratio is clamped before exp: a ratio of e^20 already saturates every clip, and the clamp
# keeps an inf out of the loss when the policy has moved very far on some token.
_MAX_LOG_RATIO = 20.0
_WHITEN_EPS = 1e-8
# The low-variance KL estimator is bounded as in common practice: a single token with a huge
# log-ratio must not dominate the penalty.
_K3_BOUND = 10.0
#: A group's population std of scores at or below this counts as no spread (`is_flat`).
FLAT_SPREAD = 1e-9


# ---- aggregation ---------------------------------------------------------------------------


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean of ``x`` over ``mask``."""
    return masked_sum(x, mask) / mask.sum().clamp(min=1)


def aggregate(x: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``sum(weights * x)`` over ``mask`` (`stages.training.loss_agg`); without weights, the token mean."""
    return masked_mean(x, mask) if weights is None else masked_sum(x * weights, mask)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased (Bessel-corrected) variance of ``x`` over ``mask``; 0 for fewer than 2 tokens."""
    count = mask.sum()
    mean = masked_sum(x, mask) / count.clamp(min=1)
    squares = masked_sum((x - mean) ** 2, mask)
    return squares / (count - 1) if count > 1 else torch.zeros_like(squares)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with mean and unbiased variance over the masked tokens."""
    mean = masked_sum(x, mask) / mask.sum().clamp(min=1)
    return (x - mean) * torch.rsqrt(masked_var(x, mask) + _WHITEN_EPS) * mask


# ---- advantage estimators ------------------------------------------------------------------


@torch.no_grad()
def masked_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
               cut: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level generalised advantage estimation over the masked steps; returns (advantages, returns).

    For a step t, let n(t) be the next step of the same row (the next position with mask 1).
    Then ``delta_t = r_t + gamma * V_n(t) - V_t`` and ``A_t = delta_t + gamma * lam * A_n(t)``, with
    ``V`` and ``A`` taken as 0 after the last step. ``returns = A + V`` (the critic's target).
    Rewards on positions where the mask is 0 are ignored: place them on a step.

    ``cut`` (bool, optional) marks steps after which the future is not followed: n(t) counts as
    past the end there (the bi-level estimator uses it to end each turn).

    With gamma = lam = 1 this is ``A_t = (sum of rewards from t on) - V_t``, i.e. ``R - V_t`` when
    the only reward is the episode's, on its last step.
    """
    mask = mask.to(values.dtype)
    keep = torch.ones_like(mask) if cut is None else 1.0 - cut.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_value = next_value * keep[:, t]
        next_advantage = next_advantage * keep[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        step = mask[:, t]
        advantages[:, t] = advantage * step
        # Non-steps pass the next step's value and advantage through unchanged.
        next_value = step * values[:, t] + (1 - step) * next_value
        next_advantage = step * advantage + (1 - step) * next_advantage
    return advantages, (advantages + values) * mask


@torch.no_grad()
def bilevel_gae(turn_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, turn_ends: torch.Tensor,
                gamma: float, lam: float, turn_gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level GAE, then token-level GAE inside each turn; returns (advantages, returns).

    VAGEN's Bi-Level GAE (its ``bi_level_gae`` estimator, which values a turn at its last token):

    1. Each turn k ends at its last model token e_k (``turn_ends``), where its reward r_k sits
       (``turn_rewards``: the turn's env reward, format penalty and state reward; 0 elsewhere). The
       turn's value is the critic's value there, ``U_k = V[e_k]``.
    2. Turn level: ``masked_gae`` over the turn ends alone, with ``turn_gamma`` and ``lam``:
       ``D_k = r_k + turn_gamma * U_{k+1} - U_k``, ``Â_k = D_k + turn_gamma * lam * Â_{k+1}``,
       and the turn's return ``G_k = Â_k + U_k``.
    3. Token level: ``masked_gae`` over the turn's own steps with ``gamma`` and ``lam``, reward
       ``G_k`` on e_k and no bootstrap past e_k. So the last token of turn k gets ``Â_k`` and an
       earlier token t gets the usual token-level GAE that ends in ``G_k``.

    With one reward on the last turn and turn_gamma = gamma = lam = 1 it equals ``masked_gae``.
    """
    turn_ends = turn_ends.to(values.dtype) * mask.to(values.dtype)
    _, turn_returns = masked_gae(turn_rewards, values, turn_ends, turn_gamma, lam)
    return masked_gae(turn_returns, values, mask, gamma, lam, cut=turn_ends.bool())


@torch.no_grad()
def group_advantages(scores: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6,
                     norm_by_std: bool = True) -> torch.Tensor:
    """GRPO-style critic-free advantage, one per episode: ``(r - group mean) / (group std + eps)``.

    The std is the unbiased sample std of the group. Without ``norm_by_std`` (verl's
    ``norm_adv_by_std_in_grpo: False``, Dr. GRPO) the advantage is ``r - group mean``: a group whose
    scores differ by a format penalty alone gets advantages of that size, not the same +-1.5 as a
    group where one episode solved the puzzle. A group of one episode has no baseline to compare
    with and gets advantage 0. Broadcast to tokens with ``advantage[:, None] * mask``.
    """
    advantages = torch.zeros_like(scores)
    for group in torch.unique(groups):
        members = groups == group
        if members.sum() < 2:
            continue
        group_scores = scores[members]
        centred = group_scores - group_scores.mean()
        advantages[members] = centred / (group_scores.std() + eps) if norm_by_std else centred
    return advantages


# ---- losses --------------------------------------------------------------------------------


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = 3.0,
                weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip and dual clip (`aggregate`d); returns (loss, stats).

    Per token, with ratio ``ρ = exp(logp - old_logp)``:
    ``L = max(-A ρ, -A clip(ρ, 1 - clip_low, 1 + clip_high))``, and where ``A < 0`` the dual clip
    bounds it further: ``L = min(L, -A * dual_clip)`` (a ratio that exploded on a bad token cannot
    produce an unbounded step). ``dual_clip=None`` turns the dual clip off.

    Stats (detached): ``pg_loss`` (the loss's token mean, whatever the weights), ``clip_frac``
    (tokens where the clipped term is the larger, i.e. clipping is active), ``dual_clip_frac``,
    ``ppo_kl`` (mean of old_logp - logp, the k1 estimate of KL(old || new)), all token means over
    the mask.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    stats = {
        "pg_loss": masked_mean(loss, mask).detach(),
        "clip_frac": masked_mean((clipped > unclipped).to(mask.dtype), mask).detach(),
        "dual_clip_frac": masked_mean(dual.to(mask.dtype), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return aggregate(loss, mask, weights), stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.5,
               weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * max((V - G)^2, (V_clip - G)^2)`` (`aggregate`d); returns (loss, stats).

    ``V_clip = old_V + clip(V - old_V, -clip, clip)`` keeps the critic within ``clip`` of the value
    it had at rollout time. The factor is 0.5 (so the gradient is ``V - G``). Stats (token means):
    ``value_loss``, ``vf_clip_frac`` (tokens where the clipped error is the larger).
    """
    mask = mask.to(values.dtype)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_error, clipped_error)
    stats = {"value_loss": masked_mean(loss, mask).detach(),
             "vf_clip_frac": masked_mean((clipped_error > unclipped_error).to(mask.dtype), mask).detach()}
    return aggregate(loss, mask, weights), stats


def logprobs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``token_ids`` under ``logits`` (same leading shape), in fp32.

    The backward writes the gradient into the saved log-softmax, where autograd's gather and
    log-softmax backwards fill a zero ``[..., vocab]`` gradient, scatter into it and pass over it
    twice more: SFT's and PPO's cross-entropy over a vocabulary of 49k to 152k."""
    return _Logprobs.apply(logits, token_ids)


class _Logprobs(torch.autograd.Function):
    """With ``L = log_softmax(z)``: ``d L[t] / dz = onehot(t) - exp(L)``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_ids: torch.Tensor):
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        ctx.save_for_backward(log_probs, token_ids)
        ctx.logits_dtype = logits.dtype
        return log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor):
        log_probs, token_ids = ctx.saved_tensors
        grad = log_probs.exp_().mul_(grad_logprobs.unsqueeze(-1)).neg_()  # the saved tensor, used once
        grad.scatter_add_(-1, token_ids.unsqueeze(-1), grad_logprobs.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None


def logprobs_and_entropy(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs_from_logits` and the entropy ``-sum(p log p)`` of each position's softmax, in fp32
    (or the logits' wider precision).

    The backward keeps one ``[..., vocab]`` tensor, the log-softmax, where autograd through the
    formulas would keep four (the logits, the softmax, the log-softmax and their product): at a
    vocabulary of 49k to 152k these are the largest tensors of PPO's update."""
    return _LogprobsAndEntropy.apply(logits, token_ids)


class _LogprobsAndEntropy(torch.autograd.Function):
    """With ``L = log_softmax(z)``, ``p = exp(L)``, ``H = -sum(p * L)``: ``d L[t] / dz = onehot(t) - p``
    and ``dH / dz = -p * (L + H)``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_ids: torch.Tensor):
        log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        entropy = log_probs.exp().mul_(log_probs).sum(-1).neg_()  # in place: one [..., vocab] temporary
        ctx.save_for_backward(log_probs, token_ids, entropy)
        ctx.logits_dtype = logits.dtype
        return log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1), entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor):
        log_probs, token_ids, entropy = ctx.saved_tensors
        grad = (log_probs + entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
        grad.add_(grad_logprobs.unsqueeze(-1)).mul_(log_probs.exp()).neg_()
        grad.scatter_add_(-1, token_ids.unsqueeze(-1), grad_logprobs.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    ``k1 = logp - ref_logp`` (unbiased, high variance, can be negative);
    ``k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1`` (unbiased, non-negative, low variance),
    clamped to [-10, 10].
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k3":
        return (torch.exp(-log_ratio) + log_ratio - 1).clamp(-_K3_BOUND, _K3_BOUND)
    raise ValueError(f"unknown KL estimator {kind!r}; use k1 or k3")


# ---- diagnostics ---------------------------------------------------------------------------


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(G - V) / Var(G)`` over the mask: 1 is a perfect critic, 0 no better than a constant.

    NaN when the returns have (almost) no variance: there is nothing to explain, and a ratio over
    float noise would be meaningless.
    """
    mask = mask.to(values.dtype)
    var_returns = masked_var(returns, mask)
    if var_returns <= _WHITEN_EPS:
        return float("nan")
    return float(1 - masked_var(returns - values, mask) / var_returns)


# ---- rollout filtering ---------------------------------------------------------------------


def groups_to_keep(num_groups: int, ratio: float) -> int:
    """How many groups a filter ratio keeps: floor(num_groups * ratio), guarded against float dust."""
    kept = math.floor(num_groups * ratio + 1e-9)
    if kept < 1:
        raise UserError(f"ppo.filter_ratio={ratio} keeps no group out of rollout.groups={num_groups}; "
                        f"raise it to at least {1 / num_groups:.4g} or use more groups")
    return kept


def group_spreads(scores: list[float], groups: list[int]) -> dict[int, float]:
    """The population std of each group's scores, the groups in first-appearance order."""
    by_group: dict[int, list[float]] = {g: [] for g in dict.fromkeys(groups)}
    for score, group in zip(scores, groups, strict=True):
        by_group[group].append(score)
    return {g: float(torch.tensor(s, dtype=torch.float64).std(unbiased=False)) for g, s in by_group.items()}


def filter_groups(scores: list[float], groups: list[int], ratio: float, include_zero: bool = True) -> list[int]:
    """Keep the ``ratio`` of groups whose rewards vary the most; returns the kept episode indices.

    Groups are ranked by the population std of their episodes' scores, largest first; ties keep
    the group that appears first in ``groups``, so the choice is deterministic. Indices come back
    in their original order.

    With ``include_zero`` off (RAGEN's ``rollout_filter_include_zero: False``) a group whose scores
    do not vary (`is_flat`) is never kept: the ratio's number of groups is taken from the others,
    all of them when fewer vary, and none when no group varies.
    """
    spread = group_spreads(scores, groups)
    order = list(spread)  # groups in first-appearance order
    count = groups_to_keep(len(order), ratio)
    candidates = order if include_zero else [g for g in order if not is_flat(spread[g])]
    ranked = sorted(candidates, key=lambda g: -spread[g])  # sorted() is stable: ties stay in order
    kept = set(ranked[:count])
    return [i for i, group in enumerate(groups) if group in kept]


def is_flat(spread: float) -> bool:
    """Whether a group's reward spread is none: its scores differ by float rounding at most.

    A score is a sum of a few dozen rewards of magnitude <= 10, whose rounding is below 1e-12; the
    smallest real difference between two episodes is a share of a state reward, above 1e-3."""
    return spread <= FLAT_SPREAD
