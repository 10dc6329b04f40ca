"""Packing a group's episodes into one sequence (their shared first prompt once): the actor's
log-probs, the critic's values and the gradients equal the unpacked passes', with the packed
rows' attention computed block by block (`packed_attention`, as `load_model` sets SDPA up)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from stages.common import models
from stages.training import loss_agg
from stages.training import ppo_algos as algos
from stages.training.policy import StepPolicy, ValueModel
from stages.training.ppo_samples import (
    Sample,
    collate,
    micro_batches,
    pack_row,
    packed_length,
    score,
    shared_prefix,
    step_count,
)

PAD = 0


def sample(ids: list[int], first_step: int, group: int) -> Sample:
    """A sample whose steps are every token from `first_step` on (as with loss_mask="all")."""
    ids_t = torch.tensor(ids)
    positions = torch.arange(first_step, len(ids))
    steps = len(positions)
    zeros = torch.zeros(steps)
    return Sample(ids_t, positions, torch.ones(steps, dtype=torch.bool), None, zeros, zeros,
                  torch.zeros(steps, dtype=torch.bool), 0.0, group)


def two_groups(vocab: int) -> list[Sample]:
    """Group 0: three episodes sharing a 24-token prompt; one continues like another for two tokens
    (their sampled starts coincide). Group 1: two episodes sharing 17 tokens. Steps start inside the
    shared prompt, so some steps are predicted from prefix positions."""
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(5, vocab, (n,), generator=g).tolist()

    prompt0, prompt1 = tokens(24), tokens(17)
    a = prompt0 + tokens(9)
    b = prompt0 + a[24:26] + tokens(6)
    c = prompt0 + tokens(14)
    d = prompt1 + tokens(5)
    e = prompt1 + tokens(11)
    return [sample(a, 20, 0), sample(b, 20, 0), sample(c, 22, 0), sample(d, 3, 1), sample(e, 16, 1)]


def test_pack_row_lays_out_prefix_and_continuations():
    row = [sample([1, 2, 3, 7, 8], 1, 0), sample([1, 2, 3, 9], 1, 0)]
    assert shared_prefix(row) == 3 and packed_length(row) == 3 + 2 + 1
    ids, positions, mask, where = pack_row(row)
    assert ids.tolist() == [1, 2, 3, 7, 8, 9]
    assert positions.tolist() == [0, 1, 2, 3, 4, 3]
    assert [w.tolist() for w in where] == [[0, 1, 2, 3, 4], [0, 1, 2, 5]]
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0],
                                   [1, 1, 0, 0, 0, 0],
                                   [1, 1, 1, 0, 0, 0],
                                   [1, 1, 1, 1, 0, 0],
                                   [1, 1, 1, 1, 1, 0],
                                   [1, 1, 1, 0, 0, 1]]
    # identical episodes keep one token each of their own
    twins = [sample([1, 2, 3], 1, 0), sample([1, 2, 3], 1, 0)]
    assert shared_prefix(twins) == 2 and pack_row(twins)[0].tolist() == [1, 2, 3, 3]


def test_micro_batches_pack_groups_within_the_token_budget():
    samples = two_groups(vocab=50)
    rows = [[s.group for s in row] for micro in micro_batches(samples, 4096, pack=True) for row in micro]
    assert sorted(rows) == [[0, 0, 0], [1, 1]]
    budget = 24 + 9 + 8  # group 0 no longer fits one row: it is split, each part still packed
    micros = micro_batches(samples, budget, pack=True)
    assert all(packed_length(row) * len(micro) <= budget or len(micro) == 1 for micro in micros for row in micro)
    assert sorted(len(s.ids) for micro in micros for row in micro for s in row) == sorted(len(s.ids) for s in samples)
    unpacked = micro_batches(samples, 4096)
    assert all(len(row) == 1 for micro in unpacked for row in micro)


def test_packed_attention_equals_sdpa_under_the_packed_mask():
    """Block by block (grouped heads: 6 query heads on 2 key/value heads; a padded row) gives the
    outputs and input gradients of transformers' SDPA under `pack_row`'s dense mask, at every real
    position; padding positions get zeros."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch = collate(micro_batches(two_groups(vocab=50), 4096, pack=True)[0], "cpu", PAD)
    assert batch["segments"] == [(17, [5, 11]), (24, [9, 8, 14])]  # shortest row first
    width = batch["input_ids"].shape[1]
    real = torch.zeros(2, width, dtype=torch.bool)
    real[0, :17 + 5 + 11], real[1] = True, True
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, heads, width, 8, generator=g, requires_grad=True) for heads in (6, 2, 2)]
    weights = torch.randn(2, width, 6, 8, generator=g)
    module = torch.nn.Module().train()
    module.num_key_value_groups, module.is_causal = 3, True
    outputs = []
    for attend in (lambda q, k, v: sdpa_attention_forward(module, q, k, v, batch["attention_mask"], scaling=0.3)[0],
                   lambda q, k, v: models.packed_attention(q, k, v, batch["segments"], scaling=0.3)[0]):
        out = attend(*inputs)
        grads = torch.autograd.grad((out * weights)[real].sum(), inputs)
        outputs.append((out, grads))
    (dense, dense_grads), (blocks, block_grads) = outputs
    torch.testing.assert_close(blocks[real], dense[real], rtol=1e-5, atol=1e-6)
    assert not blocks[~real].any()
    for ours, stock in zip(block_grads, dense_grads, strict=True):
        torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def networks(tokenizer):
    models._use_spa_sdpa()  # as load_model does: packed rows take `packed_attention`
    torch.manual_seed(0)
    actor = tiny_model(tokenizer, seed=1)
    critic = ValueModel(tiny_model(tokenizer, seed=2))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # not the zero start: values must differ
    return StepPolicy(actor, temperature=0.7), critic


@pytest.mark.parametrize("field", ["old_logprobs", "values"])
def test_packed_scores_equal_unpacked(networks, tokenizer, field):
    policy, critic = networks
    forward = critic if field == "values" else policy
    unpacked, packed = two_groups(len(tokenizer)), two_groups(len(tokenizer))
    score(forward, [(micro, 1.0) for micro in micro_batches(unpacked, 4096, pack=False)], (field,), "cpu", PAD)
    score(forward, [(micro, 1.0) for micro in micro_batches(packed, 4096, pack=True)], (field,), "cpu", PAD)
    for a, b in zip(unpacked, packed, strict=True):
        torch.testing.assert_close(getattr(b, field), getattr(a, field), rtol=1e-5, atol=1e-5)


def test_packed_batches_take_the_block_by_block_attention(networks, tokenizer, monkeypatch):
    original, calls = models.packed_attention, []

    def counted(*args, **kwargs):
        calls.append(args[3])  # the segments
        return original(*args, **kwargs)

    monkeypatch.setattr(models, "packed_attention", counted)
    _, critic = networks
    batch = collate(micro_batches(two_groups(len(tokenizer)), 4096, pack=True)[0], "cpu", PAD)
    critic(**batch)
    assert calls and all(segments == batch["segments"] for segments in calls)


@pytest.mark.parametrize("mode", loss_agg.LOSS_AGGS)
def test_packed_gradients_equal_unpacked(networks, tokenizer, mode):
    """The PPO policy loss plus the value loss over one mini-batch, aggregated as ``ppo.loss_agg``
    says: in one unpacked micro-batch, and packed over several micro-batches with gradient
    accumulation, the same loss and the same gradient for every parameter (to 1e-5 relative, fp32)."""
    policy, critic = networks

    def gradients(pack: bool, budget: int) -> tuple[float, dict[str, torch.Tensor]]:
        samples = two_groups(len(tokenizer))
        g = torch.Generator().manual_seed(3)
        for s in samples:
            s.old_logprobs = -torch.rand(s.steps, generator=g) * 3
            s.advantages = torch.randn(s.steps, generator=g)
            s.values, s.returns = torch.randn(s.steps, generator=g), torch.randn(s.steps, generator=g)
        normalizer = loss_agg.batch_normalizer(mode, sum(s.steps for s in samples), len(samples))
        policy.zero_grad()
        critic.zero_grad()
        total, micros = 0.0, micro_batches(samples, budget, pack)
        for rows in micros:
            batch = collate(rows, "cpu", PAD)
            ordered = [s for row in rows for s in row]
            weights = loss_agg.token_weights(loss_agg.sequence_index(step_count(rows)), mode, normalizer)
            logprobs, entropy, _ = policy(**batch, with_entropy=True)
            loss, _ = algos.policy_loss(logprobs, torch.cat([s.old_logprobs for s in ordered]),
                                        torch.cat([s.advantages for s in ordered]), torch.ones_like(logprobs),
                                        weights=weights)
            loss = loss - 0.01 * (entropy * weights).sum()
            values = critic(**batch)
            value_loss, _ = algos.value_loss(values, torch.cat([s.values for s in ordered]),
                                             torch.cat([s.returns for s in ordered]), torch.ones_like(values),
                                             weights=weights)
            (loss + value_loss).backward()
            total += (loss + value_loss).item()
        assert len(micros) == (1 if budget > 1000 else 2)
        named = list(policy.named_parameters()) + [(f"critic.{n}", p) for n, p in critic.named_parameters()]
        return total, {name: p.grad.clone() for name, p in named if p.grad is not None}

    loss_a, grads_a = gradients(pack=False, budget=4096)
    loss_b, grads_b = gradients(pack=True, budget=80)
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name in grads_a:
        scale = max(1.0, grads_a[name].abs().max().item())  # fp32 sums err in proportion to their size
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6 * scale, msg=name)
