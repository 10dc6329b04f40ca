"""The LM head over chunks of positions (`stages.training.policy.head_logprobs`), shared by SFT's
cross-entropy and PPO's log-probs and entropies: the same values and gradients as the head over
all positions at once, and no chunk larger than its budget in the forward pass or the backward.

Tolerance (fp32): a chunk computes the same dot products as the whole, only grouped into other
matrix products, and the head's weight gradient sums the chunks' parts in another order. Each sum
here has at most VOCAB = 97 terms (hidden size 32, 21 positions), so regrouping moves it by at most
97 * 2**-24 ~ 6e-6 of its terms' magnitude; a gradient passes through ~4 such sums (head, two
layers, embedding): 3e-5 relative, with a floor of that times the largest entry for entries near 0.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import small_llama

from stages import sft
from stages.training import policy as policy_module
from stages.training import ppo_algos as algos
from stages.training.policy import StepPolicy

VOCAB = 97
CHUNK = 3  # positions per chunk, forced: the fixtures score 21 positions, 7 chunks
TOLERANCE = 4 * VOCAB * 2**-24


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(policy_module, "HEAD_CHUNK_BYTES", CHUNK * 4 * VOCAB)
    assert policy_module.head_chunk(VOCAB) == CHUNK


def two_rows(seed: int = 1):
    """Token ids ``[2, 16]`` and 21 scored positions over both rows, with their next tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 16), generator=generator)
    rows = torch.tensor([0] * 11 + [1] * 10)
    cols = torch.cat([torch.arange(2, 13), torch.arange(5, 15)])
    return ids, rows, cols, ids[rows, cols + 1]


def gradients(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE, atol=TOLERANCE * expected.abs().max().item(),
                               msg=msg)


def assert_same_gradients(actual: dict, expected: dict) -> None:
    assert len(expected) > 10 and actual.keys() == expected.keys()
    for name, grad in expected.items():
        assert grad.abs().max() > 0, name
        assert_close(actual[name], grad, msg=name)


def test_ppo_log_probs_entropies_values_and_gradients_match_the_whole_head(small_chunks):
    """StepPolicy with a shared value head, at temperature 0.7, against the model's own logits of
    every position, scored by the same formulas without chunks."""
    lm = small_llama()
    policy = StepPolicy(lm, temperature=0.7, value_lr=1e-4)
    torch.nn.init.normal_(policy.value_head.weight, std=0.5)
    ids, rows, cols, targets = two_rows()
    weights = torch.randn(3, len(rows), generator=torch.Generator().manual_seed(2))

    logprobs, entropy, values = policy(ids, None, rows, cols, targets, with_entropy=True, with_values=True)
    chunked = gradients(policy, (weights[0] * logprobs + weights[1] * entropy + weights[2] * values).sum())

    out = lm(input_ids=ids, output_hidden_states=True)
    expected_logprobs, expected_entropy = algos.logprobs_and_entropy(out.logits[rows, cols] / 0.7, targets)
    expected_values = policy.value_head(out.hidden_states[-1][rows, cols]).squeeze(-1)
    whole = gradients(policy, (weights[0] * expected_logprobs + weights[1] * expected_entropy
                               + weights[2] * expected_values).sum())

    assert_close(logprobs, expected_logprobs)
    assert_close(entropy, expected_entropy)
    assert_close(values, expected_values)
    assert_same_gradients(chunked, whole)


def test_sft_cross_entropy_and_its_gradient_match_the_whole_head(small_chunks):
    """`spa sft`'s token cross-entropy against torch's cross-entropy of the model's logits."""
    lm = small_llama()
    ids, _, keep, _ = two_rows()
    keep = keep[:11]  # one row: SFT's micro-batch is one sequence
    ids = ids[:1]
    batch = {"input_ids": ids, "position_ids": torch.arange(16).unsqueeze(0), "keep": keep,
             "targets": ids[0, keep + 1]}
    weights = torch.rand(len(keep), generator=torch.Generator().manual_seed(3))

    ce = sft.token_ce(StepPolicy(lm, temperature=1.0), batch)
    chunked = gradients(lm, (weights * ce).sum())
    expected = F.cross_entropy(lm(input_ids=ids).logits[0, keep], batch["targets"], reduction="none")
    whole = gradients(lm, (weights * expected).sum())

    assert_close(ce, expected)
    assert_same_gradients(chunked, whole)


def test_the_head_never_sees_more_than_a_chunk(small_chunks):
    """Forward and backward (which recomputes each chunk's logits) run the head on at most CHUNK
    positions at a time: 7 chunks of 21 positions, each computed twice; without gradients once."""
    lm = small_llama()
    policy = StepPolicy(lm, temperature=1.0)  # its probe of the head runs before the count
    seen: list[int] = []
    lm.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    ids, rows, cols, targets = two_rows()
    logprobs, entropy, _ = policy(ids, None, rows, cols, targets, with_entropy=True)
    assert seen == [CHUNK] * 7
    (logprobs.sum() + entropy.sum()).backward()
    assert seen == [CHUNK] * 14
    seen.clear()
    with torch.no_grad():
        policy(ids, None, rows, cols, targets)
    assert seen == [CHUNK] * 7


def test_a_head_that_is_not_plain_scores_the_requested_columns_alike():
    """A model whose logits are not a plain map of its last hidden state (forced here) is scored
    from its own logits of the requested columns: the same figures."""
    lm = small_llama()
    ids, rows, cols, targets = two_rows()
    plain = StepPolicy(lm, temperature=0.7, value_lr=1e-4)
    torch.nn.init.normal_(plain.value_head.weight, std=0.5)
    whole = StepPolicy(lm, temperature=0.7, value_lr=1e-4)
    whole.value_head.load_state_dict(plain.value_head.state_dict())
    whole.plain_head = False
    with torch.no_grad():
        expected = plain(ids, None, rows, cols, targets, with_entropy=True, with_values=True)
        scores = whole(ids, None, rows, cols, targets, with_entropy=True, with_values=True)
    for actual, wanted in zip(scores, expected, strict=True):
        assert_close(actual, wanted)
