"""Packing a micro-batch's episodes into one prefix-tree sequence (what all share once, each
group's first prompt once): the actor's log-probs, the critic's values and the gradients equal the
unshared passes', with the attention computed node by node (`tree_attention`, as `load_model`
sets SDPA up).

Tolerances (fp32, unit roundoff u = 2**-24 ~ 6e-8): shared and unshared passes compute the same
sums of the same terms, only grouped differently by the kernels (other shapes), so each sum may
differ by at most ~n u of its terms' magnitude, n <= 128 terms here (sequence and hidden sizes):
~1e-5 per sum, a few sums in series per layer over two layers (and the backward once more):
1e-4 relative, with an absolute floor of 1e-4 x the tensor's largest entry for entries near 0.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from stages.common import prefix_tree
from stages.common.kernels.attention import register_spa_sdpa
from stages.training import loss_agg
from stages.training import ppo_algos as algos
from stages.training.policy import StepPolicy, ValueModel
from stages.training.ppo_samples import Sample, collate, micro_batches, score, step_count

PAD = 0
RTOL = 1e-4


def assert_close(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    floor = RTOL * float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=floor, msg=msg or None)


def sample(ids: list[int], first_step: int, group: int) -> Sample:
    """A sample whose steps are every token from `first_step` on (as with loss_mask="all")."""
    ids_t = torch.tensor(ids)
    positions = torch.arange(first_step, len(ids))
    steps = len(positions)
    zeros = torch.zeros(steps)
    return Sample(ids_t, positions, torch.ones(steps, dtype=torch.bool), None, zeros, zeros,
                  torch.zeros(steps, dtype=torch.bool), 0.0, group)


def two_groups(vocab: int) -> list[Sample]:
    """Two groups behind a 6-token instruction they all share. Group 0: three episodes sharing a
    24-token prompt; one continues like another for two tokens (their sampled starts coincide).
    Group 1: two episodes sharing 17 tokens. Steps start inside the shared prompt, so some steps
    are predicted from prefix positions."""
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(5, vocab, (n,), generator=g).tolist()

    instruction = tokens(6)
    prompt0, prompt1 = instruction + tokens(18), instruction + tokens(11)
    a = prompt0 + tokens(9)
    b = prompt0 + a[24:26] + tokens(6)
    c = prompt0 + tokens(14)
    d = prompt1 + tokens(5)
    e = prompt1 + tokens(11)
    return [sample(a, 20, 0), sample(b, 20, 0), sample(c, 22, 0), sample(d, 3, 1), sample(e, 16, 1)]


def test_pack_lays_out_a_prefix_tree():
    rows = [[1, 2, 3, 7, 8], [1, 2, 3, 9], [1, 2, 3], [5, 6], [1, 2, 3, 7, 4]]
    packed = prefix_tree.pack(rows)
    assert packed.ids == [1, 2, 3, 7, 4, 8, 9, 5, 6]
    assert packed.positions == [0, 1, 2, 3, 4, 4, 3, 0, 1]
    assert packed.nodes == [(0, 3, -1), (3, 4, 0), (4, 5, 1), (5, 6, 1), (6, 7, 0), (7, 9, -1)]
    assert packed.where == [[0, 1, 2, 3, 5], [0, 1, 2, 6], [0, 1, 2], [7, 8], [0, 1, 2, 3, 4]]
    assert prefix_tree.packed_length(rows) == len(packed) == 9
    for row, where in zip(rows, packed.where, strict=True):  # every row reads back from its indices
        assert [packed.ids[i] for i in where] == row and [packed.positions[i] for i in where] == list(range(len(row)))
    mask = prefix_tree.TreeLayout(packed.nodes).dense_mask()
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0, 0, 0, 0],
                                   [1, 1, 0, 0, 0, 0, 0, 0, 0],
                                   [1, 1, 1, 0, 0, 0, 0, 0, 0],
                                   [1, 1, 1, 1, 0, 0, 0, 0, 0],
                                   [1, 1, 1, 1, 1, 0, 0, 0, 0],
                                   [1, 1, 1, 1, 0, 1, 0, 0, 0],
                                   [1, 1, 1, 0, 0, 0, 1, 0, 0],
                                   [0, 0, 0, 0, 0, 0, 0, 1, 0],
                                   [0, 0, 0, 0, 0, 0, 0, 1, 1]]
    twins = prefix_tree.pack([[4, 5, 6], [4, 5, 6]])  # identical rows share every token
    assert twins.ids == [4, 5, 6] and twins.where == [[0, 1, 2], [0, 1, 2]]
    layout = prefix_tree.TreeLayout(packed.nodes)  # what `tree_attention` splits the sequence by
    assert layout.sizes == [3, 1, 1, 1, 1, 2] and layout.ancestors == [[], [0], [0, 1], [0, 1], [0], []]
    with pytest.raises(ValueError, match="tile the sequence"):  # a gap: the split would misplace nodes
        prefix_tree.TreeLayout([(0, 3, -1), (4, 5, 0)])


def test_micro_batches_share_within_the_token_budget():
    samples = two_groups(vocab=50)
    (only,) = micro_batches(samples, 4096, share=True)
    assert len(only) == 1 and sorted(s.group for s in only[0]) == [0, 0, 0, 1, 1]
    assert prefix_tree.packed_length([s.ids.tolist() for s in only[0]]) == 6 + 18 + 9 + 6 + 14 + 11 + 5 + 11
    budget = 6 + 11 + 5 + 11 + 18 + 9  # no longer one tree: cut where the next sample would exceed it
    micros = micro_batches(samples, budget, share=True)
    assert len(micros) > 1 and all(len(micro) == 1 for micro in micros)
    assert all(prefix_tree.packed_length([s.ids.tolist() for s in micro[0]]) <= budget for micro in micros)
    assert sorted(len(s.ids) for micro in micros for s in micro[0]) == sorted(len(s.ids) for s in samples)
    unshared = micro_batches(samples, 4096)
    assert all(len(row) == 1 for micro in unshared for row in micro)


def attention_inputs(length: int, heads=(6, 2, 2), seed: int = 0, head_dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(1, h, length, head_dim, generator=g, requires_grad=True) for h in heads]
    return inputs, torch.randn(1, length, heads[0], head_dim, generator=g)


def outputs_and_grads(attend, inputs, weights):
    out = attend(*inputs)
    return out, torch.autograd.grad((out * weights).sum(), inputs)


@pytest.mark.parametrize("query_block", [prefix_tree.QUERY_BLOCK, 5])
def test_tree_attention_equals_sdpa_under_the_dense_tree_mask(query_block):
    """Node by node (grouped heads: 6 query heads on 2 key/value heads), a node's queries in one
    call or in blocks of 5 (nodes of 5 to 18 tokens: whole, cut and partial blocks), gives the
    outputs and input gradients of transformers' SDPA under the tree's dense mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    nodes = collate(micro_batches(two_groups(vocab=50), 4096, share=True)[0], "cpu", PAD)["layout"].nodes
    layout = prefix_tree.TreeLayout(nodes, query_block=query_block)
    assert any(end - start > query_block and parent >= 0 for start, end, parent in nodes) or query_block > 5
    inputs, weights = attention_inputs(layout.length)
    module = torch.nn.Module().train()
    module.num_key_value_groups, module.is_causal = 3, True
    dense = outputs_and_grads(lambda q, k, v: sdpa_attention_forward(
        module, q, k, v, layout.dense_mask()[None, None], scaling=0.3)[0], inputs, weights)
    tree = outputs_and_grads(lambda q, k, v: prefix_tree.tree_attention(q, k, v, layout, scaling=0.3)[0],
                             inputs, weights)
    for ours, stock in zip([tree[0], *tree[1]], [dense[0], *dense[1]], strict=True):
        assert_close(ours, stock)


def test_flex_attention_mask_mod_is_the_tree_and_matches_sdpa_per_node():
    """FlexAttention's path, eager on the CPU (which has no FlexAttention backward: the gradients
    are checked on CUDA, below): its mask_mod expands to the tree's dense mask, and its outputs
    equal the per-node SDPA path's."""
    from torch.nn.attention.flex_attention import create_mask

    layout = collate(micro_batches(two_groups(vocab=50), 4096, share=True)[0], "cpu", PAD)["layout"]
    expanded = create_mask(layout.mask_mod(), 1, 1, layout.length, layout.length, device="cpu")
    assert torch.equal(expanded[0, 0], layout.dense_mask())
    q, k, v = (x.detach() for x in attention_inputs(layout.length)[0])
    with torch.no_grad():
        flex = prefix_tree.tree_attention(q, k, v, layout, scaling=0.3, flex=True)[0]
        nodes = prefix_tree.tree_attention(q, k, v, layout, scaling=0.3, flex=False)[0]
    assert_close(flex, nodes)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 5])
def test_compiled_flex_attention_equals_sdpa_per_node_on_cuda(window):
    """The CUDA path (compiled FlexAttention, bf16 inputs, its block mask from the node ranges)
    against the per-node SDPA path, on a tree of many nodes, with and without a sliding window;
    bf16's unit roundoff 2**-8 over sums of up to 64 terms bounds the gap."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    batch = collate(micro_batches(two_groups(vocab=50), 4096, share=True)[0], "cuda", PAD)
    layout = batch["layout"]
    inputs, weights = attention_inputs(layout.length, head_dim=16)  # compiled FlexAttention needs >= 16 on CUDA
    inputs = [x.detach().cuda().bfloat16().requires_grad_() for x in inputs]
    weights = weights.cuda().bfloat16()
    flex = outputs_and_grads(lambda q, k, v: prefix_tree.tree_attention(q, k, v, layout, flex=True, window=window)[0],
                             inputs, weights)
    nodes = outputs_and_grads(lambda q, k, v: prefix_tree.tree_attention(q, k, v, layout, flex=False,
                                                                         window=window)[0], inputs, weights)
    for ours, theirs in zip([flex[0], *flex[1]], [nodes[0], *nodes[1]], strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=5e-2, atol=5e-2 * float(theirs.abs().max()))


@pytest.fixture(scope="module")
def networks(tokenizer):
    register_spa_sdpa()  # as load_model does: packed rows take `tree_attention`
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
    score(forward, [(micro, 1.0) for micro in micro_batches(unpacked, 4096, share=False)], (field,), "cpu", PAD)
    score(forward, [(micro, 1.0) for micro in micro_batches(packed, 4096, share=True)], (field,), "cpu", PAD)
    for a, b in zip(unpacked, packed, strict=True):
        assert_close(getattr(b, field), getattr(a, field))


def test_packed_batches_take_the_tree_attention(networks, tokenizer, monkeypatch):
    original, calls = prefix_tree.tree_attention, []

    def counted(*args, **kwargs):
        calls.append(args[3])  # the layout
        return original(*args, **kwargs)

    monkeypatch.setattr(prefix_tree, "tree_attention", counted)
    _, critic = networks
    batch = collate(micro_batches(two_groups(len(tokenizer)), 4096, share=True)[0], "cpu", PAD)
    critic(**batch)
    assert len(calls) == 2 and all(layout is batch["layout"] for layout in calls)  # one per layer


#: seq-mean-token-sum-norm's constant here: any number the whole mini-batch shares.
TOKEN_BUDGET = 64


@pytest.mark.parametrize("mode", loss_agg.LOSS_AGGS)
def test_packed_gradients_equal_unpacked(networks, tokenizer, mode):
    """The PPO policy loss plus the value loss over one mini-batch, aggregated as ``ppo.loss_agg``
    says: in one unpacked micro-batch, and packed over several micro-batches with gradient
    accumulation, the same loss and the same gradient for every parameter (to 1e-5 relative, fp32)."""
    policy, critic = networks

    def gradients(share: bool, budget: int) -> tuple[float, dict[str, torch.Tensor]]:
        samples = two_groups(len(tokenizer))
        g = torch.Generator().manual_seed(3)
        for s in samples:
            s.old_logprobs = -torch.rand(s.steps, generator=g) * 3
            s.advantages = torch.randn(s.steps, generator=g)
            s.values, s.returns = torch.randn(s.steps, generator=g), torch.randn(s.steps, generator=g)
        normalizer = loss_agg.batch_normalizer(mode, sum(s.steps for s in samples), len(samples), TOKEN_BUDGET)
        policy.zero_grad()
        critic.zero_grad()
        total, micros = 0.0, micro_batches(samples, budget, share)
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

    loss_a, grads_a = gradients(share=False, budget=4096)
    loss_b, grads_b = gradients(share=True, budget=60)
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name in grads_a:
        scale = max(1.0, grads_a[name].abs().max().item())  # fp32 sums err in proportion to their size
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6 * scale, msg=name)
