"""The PPO mathematics against brute-force references and hand-computed values."""

import math

import pytest
import torch

from stages.common.errors import UserError
from stages.training import ppo_algos as algos


def brute_force_gae(rewards, values, mask, gamma, lam):
    """GAE by explicit loops: list each row's steps, then the textbook recursion over that list."""
    advantages = torch.zeros_like(values, dtype=torch.float64)
    for b in range(values.shape[0]):
        steps = [t for t in range(values.shape[1]) if mask[b, t]]
        for i, t in enumerate(steps):
            total = 0.0
            for j, u in enumerate(steps[i:]):  # A_t = sum_l (gamma lam)^l delta_{t+l}
                nxt = values[b, steps[i + j + 1]].item() if i + j + 1 < len(steps) else 0.0
                delta = rewards[b, u].item() + gamma * nxt - values[b, u].item()
                total += (gamma * lam) ** j * delta
            advantages[b, t] = total
    return advantages


def random_batch(seed, batch=5, time=23):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, time, generator=generator, dtype=torch.float64)
    mask = (torch.rand(batch, time, generator=generator) < 0.6).double()
    mask[:, :2] = 0  # a prompt, then gaps of env tokens between runs of model tokens
    mask[0] = 0  # a row with no step at all
    mask[1, 2:] = 1  # a row with no gap
    rewards = torch.randn(batch, time, generator=generator, dtype=torch.float64) * mask
    return rewards, values, mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0), (0.5, 1.0)])
def test_gae_matches_brute_force_with_gaps(seed, gamma, lam):
    rewards, values, mask = random_batch(seed)
    advantages, returns = algos.masked_gae(rewards, values, mask, gamma, lam)
    expected = brute_force_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, (expected + values) * mask)
    assert advantages[0].abs().sum() == 0


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    _, values, mask = random_batch(7)
    rewards = torch.zeros_like(values)
    last = [max((t for t in range(mask.shape[1]) if mask[b, t]), default=None) for b in range(mask.shape[0])]
    final = torch.tensor([1.0, -0.1, 2.5, 0.0, 0.7], dtype=torch.float64)
    for b, t in enumerate(last):
        if t is not None:
            rewards[b, t] = final[b]
    advantages, returns = algos.masked_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(advantages, (final[:, None] - values) * mask)
    torch.testing.assert_close(returns, final[:, None] * mask)


def test_gae_skips_env_tokens_between_turns():
    # Steps at 1, 2 and 5: the value at env token 3/4 (mask 0) must not enter the recursion.
    values = torch.tensor([[9.0, 1.0, 2.0, 100.0, 100.0, 3.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0]])
    rewards = torch.tensor([[0, 0, 0, 0, 0, 10.0, 0]])
    advantages, _ = algos.masked_gae(rewards, values, mask, gamma=0.5, lam=1.0)
    # A5 = 10 - 3 = 7; A2 = (0.5*3 - 2) + 0.5*7 = 3; A1 = (0.5*2 - 1) + 0.5*3 = 1.5
    torch.testing.assert_close(advantages, torch.tensor([[0, 1.5, 3.0, 0, 0, 7.0, 0]]))


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 50.0], [3.0, -7.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]]).float()
    chosen = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected_values = (chosen - chosen.mean()) / torch.sqrt(chosen.var(unbiased=True) + 1e-8)
    whitened = algos.masked_whiten(x, mask)
    torch.testing.assert_close(whitened[mask.bool()], expected_values)
    assert whitened[~mask.bool()].abs().sum() == 0
    assert abs(algos.masked_mean(whitened, mask).item()) < 1e-6


def test_bilevel_gae_hand_computed():
    # Two turns: tokens 1-2 (turn 0, reward 1 on token 2), env tokens 3-4, tokens 5-6 (turn 1, reward 2).
    values = torch.tensor([[0.0, 0.5, 1.0, 0.0, 0.0, 2.0, 4.0]])
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1]])
    ends = torch.tensor([[0, 0, 1, 0, 0, 0, 1]])
    turn_rewards = torch.tensor([[0, 0, 1.0, 0, 0, 0, 2.0]])
    turn_gamma, gamma, lam = 0.5, 0.9, 0.8
    advantages, returns = algos.bilevel_gae(turn_rewards, values, mask, ends, gamma, lam, turn_gamma)
    # Turn level: U0 = 1, U1 = 4. D1 = 2 - 4 = -2 -> Â1 = -2, G1 = 2.
    #             D0 = 1 + 0.5*4 - 1 = 2 -> Â0 = 2 + 0.5*0.8*(-2) = 1.2, G0 = 2.2.
    # Token level, turn 1: A6 = 2 - 4 = -2; A5 = (0.9*4 - 2) + 0.72*(-2) = 0.16.
    #              turn 0: A2 = 2.2 - 1 = 1.2; A1 = (0.9*1 - 0.5) + 0.72*1.2 = 1.264.
    expected = torch.tensor([[0, 1.264, 1.2, 0, 0, 0.16, -2.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, (expected + values) * mask)


def test_bilevel_gae_reduces_to_token_gae_with_unit_discounts():
    _, values, mask = random_batch(3)
    rewards = torch.zeros_like(values)
    ends = torch.zeros_like(values)
    for b in range(mask.shape[0]):
        steps = [t for t in range(mask.shape[1]) if mask[b, t]]
        if steps:
            ends[b, steps[len(steps) // 2]] = 1  # a middle turn end, reward 0
            ends[b, steps[-1]] = 1
            rewards[b, steps[-1]] = 1.0 + b
    bilevel, _ = algos.bilevel_gae(rewards, values, mask, ends, 1.0, 1.0, 1.0)
    flat, _ = algos.masked_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(bilevel, flat)


def test_group_advantages_closed_form():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    advantages = algos.group_advantages(scores, groups, eps=1e-6)
    std0 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased std of (1, 0, 0)
    expected = torch.tensor([(2 / 3) / (std0 + 1e-6), (-1 / 3) / (std0 + 1e-6), (-1 / 3) / (std0 + 1e-6),
                             0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(advantages, expected)


def ppo_token_loss(logp, old, adv, low, high, c):
    """One token's loss written out by cases."""
    ratio = math.exp(logp - old)
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    if c is not None and adv < 0:
        loss = min(loss, -adv * c)
    return loss


@pytest.mark.parametrize("ratio, adv, expected_clipped", [
    (1.1, 1.0, False),   # inside both bounds
    (1.5, 1.0, True),    # above 1 + clip_high, positive advantage: clipped at 1.28
    (1.25, 1.0, False),  # above 1 + clip_low but under 1 + clip_high: the asymmetric clip lets it through
    (0.5, 1.0, False),   # below 1 - clip_low, positive advantage: the unclipped term is the larger
    (0.5, -1.0, True),   # below 1 - clip_low, negative advantage: clipped at 0.8
    (1.5, -1.0, False),  # above the high bound, negative advantage: unclipped, under the dual clip
    (5.0, -1.0, False),  # negative advantage and ratio above 3: the dual clip bounds it at 3
])
def test_policy_loss_single_token_cases(ratio, adv, expected_clipped):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64)
    old = torch.zeros_like(logp)
    advantages = torch.tensor([[adv]], dtype=torch.float64)
    loss, stats = algos.policy_loss(logp, old, advantages, torch.ones_like(logp), 0.2, 0.28, 3.0)
    assert loss.item() == pytest.approx(ppo_token_loss(math.log(ratio), 0.0, adv, 0.2, 0.28, 3.0))
    assert stats["clip_frac"].item() == float(expected_clipped)
    assert stats["dual_clip_frac"].item() == float(adv < 0 and ratio > 3.0)


def test_policy_loss_hand_values_and_token_mean():
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(5.0), 0.0]])
    old = torch.zeros_like(logp)
    advantages = torch.tensor([[2.0, -1.0, -0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = algos.policy_loss(logp, old, advantages, mask, 0.2, 0.28, 3.0)
    # -2*1.28 = -2.56; max(0.5, 0.8) = 0.8; min(max(2.5, 0.5*1.28), 1.5) = 1.5
    assert loss.item() == pytest.approx((-2.56 + 0.8 + 1.5) / 3)
    assert stats["clip_frac"].item() == pytest.approx(2 / 3)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert stats["ppo_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(5.0)) / 3)
    assert stats["pg_loss"].item() == pytest.approx(loss.item())
    # Weights replace the token mean (`loss_agg`: the whole mini-batch's aggregate over micro-batches).
    weights = torch.tensor([[0.5, 0.25, 0.125, 7.0]])
    weighted, stats = algos.policy_loss(logp, old, advantages, mask, 0.2, 0.28, 3.0, weights=weights)
    assert weighted.item() == pytest.approx(-2.56 * 0.5 + 0.8 * 0.25 + 1.5 * 0.125)
    assert stats["pg_loss"].item() == pytest.approx((-2.56 + 0.8 + 1.5) / 3)  # logged as the token mean


def test_policy_loss_random_against_brute_force():
    generator = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 9, generator=generator, dtype=torch.float64)
    old = torch.randn(4, 9, generator=generator, dtype=torch.float64)
    adv = torch.randn(4, 9, generator=generator, dtype=torch.float64)
    mask = (torch.rand(4, 9, generator=generator) < 0.7).double()
    for c in (3.0, None):
        loss, _ = algos.policy_loss(logp, old, adv, mask, 0.2, 0.28, c)
        tokens = [ppo_token_loss(logp[i, j].item(), old[i, j].item(), adv[i, j].item(), 0.2, 0.28, c)
                  for i in range(4) for j in range(9) if mask[i, j]]
        assert loss.item() == pytest.approx(sum(tokens) / len(tokens))


def test_policy_loss_gradient_is_zero_where_clipped():
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    loss, _ = algos.policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1 / 2]]))


@pytest.mark.parametrize("new, old, ret, expected, clipped", [
    (1.2, 1.0, 1.3, 0.5 * 0.1 ** 2, False),   # inside the clip range: plain squared error
    (2.0, 1.0, 0.0, 0.5 * 2.0 ** 2, False),   # outside, but the unclipped error is the larger
    (2.0, 1.0, 3.0, 0.5 * 1.5 ** 2, True),    # outside and the clipped value (1.5) is further: max picks it
    (0.0, 1.0, 1.0, 0.5 * 1.0 ** 2, False),   # below: clipped 0.5 has error 0.5 < 1
    (0.0, 1.0, -2.0, 0.5 * 2.5 ** 2, True),   # below: clipped 0.5 has error 2.5 > 2
])
def test_value_loss_both_branches(new, old, ret, expected, clipped):
    t = lambda v: torch.tensor([[v]], dtype=torch.float64)
    loss, stats = algos.value_loss(t(new), t(old), t(ret), torch.ones(1, 1), clip=0.5)
    assert loss.item() == pytest.approx(expected)
    assert stats["vf_clip_frac"].item() == float(clipped)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    return algos.logprobs_and_entropy(logits, torch.zeros(logits.shape[:-1], dtype=torch.long))[1]


def test_entropy_of_known_distributions():
    uniform = torch.zeros(2, 3, 8)
    torch.testing.assert_close(entropy(uniform), torch.full((2, 3), math.log(8)))
    probs = torch.tensor([0.5, 0.25, 0.25])
    shifted = entropy(torch.log(probs) + 3.0)  # shift invariance
    assert shifted.item() == pytest.approx(-(probs * probs.log()).sum().item())
    assert entropy(torch.tensor([0.0, -1e4])).item() == pytest.approx(0.0, abs=1e-6)


def test_logprobs_and_entropy_have_the_gradients_of_their_formulas():
    """Against autograd through the textbook formulas, in float64: log_softmax gathered at the
    tokens, and -sum(softmax * log_softmax), under any mix of the two in the loss."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=g, dtype=torch.float64) * 3).requires_grad_()
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    a, b = torch.randn(2, 5, generator=g, dtype=torch.float64), torch.randn(2, 5, generator=g, dtype=torch.float64)
    logprobs, entropies = algos.logprobs_and_entropy(logits, tokens)
    (ours,) = torch.autograd.grad((a * logprobs + b * entropies).sum(), logits)
    log_probs = torch.log_softmax(logits, dim=-1)
    expected_logprobs = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    expected_entropies = -(log_probs.exp() * log_probs).sum(-1)
    (expected,) = torch.autograd.grad((a * expected_logprobs + b * expected_entropies).sum(), logits)
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropies, expected_entropies, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)
    (only_logprobs,) = torch.autograd.grad(algos.logprobs_and_entropy(logits, tokens)[0].sum(), logits)
    (expected,) = torch.autograd.grad(torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).sum(), logits)
    torch.testing.assert_close(only_logprobs, expected, rtol=1e-10, atol=1e-12)


def test_logprobs_from_logits():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    lp = algos.logprobs_from_logits(logits, torch.tensor([[1, 2]]))
    torch.testing.assert_close(lp, torch.log(torch.tensor([[0.25, 0.8]])))


def test_logprobs_from_logits_has_the_gradient_of_its_formula():
    """Its own backward against autograd through log_softmax gathered at the tokens, in float64:
    each entry is a * (onehot - p) with p = exp(L) from the float32 log-softmax, whose error is a
    few roundings of the logits' range plus log(vocab)."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=g) * 3).requires_grad_()
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    a = torch.randn(2, 5, generator=g)
    logprobs = algos.logprobs_from_logits(logits, tokens)
    (ours,) = torch.autograd.grad((a * logprobs).sum(), logits)
    exact = logits.detach().double().requires_grad_()
    expected_logprobs = torch.log_softmax(exact, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (expected,) = torch.autograd.grad((a.double() * expected_logprobs).sum(), exact)
    assert torch.equal(logprobs, torch.log_softmax(logits.detach(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
    eps = torch.finfo(torch.float32).eps
    bound = 8 * eps * (logits.detach().abs().max() + math.log(11) + 1) * a.abs().max()
    assert (ours.double() - expected).abs().max() <= bound
    assert ours.dtype == logits.dtype


def test_kl_estimators():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.4)])
    torch.testing.assert_close(algos.kl_penalty(logp, ref, "k1"), logp - ref)
    r = torch.tensor([0.5, 2.0])  # ref / policy
    torch.testing.assert_close(algos.kl_penalty(logp, ref, "k3"), r - torch.log(r) - 1)
    # Both are unbiased: their expectation under the policy is the exact KL.
    policy = torch.tensor([0.5, 0.3, 0.2])
    reference = torch.tensor([0.2, 0.4, 0.4])
    exact = (policy * (policy / reference).log()).sum()
    for kind in ("k1", "k3"):
        estimate = (policy * algos.kl_penalty(policy.log(), reference.log(), kind)).sum()
        torch.testing.assert_close(estimate, exact)
    with pytest.raises(ValueError):
        algos.kl_penalty(logp, ref, "k9")


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert algos.explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0)
    assert algos.explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)
    values = torch.tensor([[1.5, 2.0, 2.5, 0.0]])  # residuals (-0.5, 0, 0.5): var 0.25 vs 1
    assert algos.explained_variance(values, returns, mask) == pytest.approx(0.75)
    assert math.isnan(algos.explained_variance(values, torch.ones_like(returns), mask))


def test_filter_keeps_the_most_varied_groups_deterministically():
    #          group 0 (std 0)  group 1 (std .5)  group 2 (std 0)  group 3 (std .5)  group 4 (std 1)
    scores = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, -1.0, 1.0]
    groups = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert algos.filter_groups(scores, groups, 0.2) == [8, 9]
    assert algos.filter_groups(scores, groups, 0.4) == [2, 3, 8, 9]  # tie 1 vs 3: the first seen wins
    assert algos.filter_groups(scores, groups, 0.6) == [2, 3, 6, 7, 8, 9]
    assert algos.filter_groups(scores, groups, 1.0) == list(range(10))
    # Interleaved groups keep their episodes' original order.
    assert algos.filter_groups([0.0, 5.0, 1.0, 5.0], [7, 3, 7, 3], 0.5) == [0, 2]


def test_filter_ratio_keeping_no_group_is_a_user_error():
    with pytest.raises(UserError, match=r"ppo.filter_ratio=0.25 keeps no group out of rollout.groups=2"):
        algos.filter_groups([0.0, 1.0, 0.0, 1.0], [0, 0, 1, 1], 0.25)
    assert algos.groups_to_keep(32, 0.25) == 8
    assert algos.groups_to_keep(100, 0.29) == 29  # float dust: 100 * 0.29 = 28.999...
