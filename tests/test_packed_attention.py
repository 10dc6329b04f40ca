"""The packed path's attention beyond the plain tree (`stages.common.prefix_tree`): sliding windows,
per layer where the model says so; grouped key/value heads through a whole model; FlexAttention's
block mask built from the node ranges; the score modifiers it refuses.

Tolerances are tests/test_ppo_packing.py's (fp32: the same sums grouped differently by the kernels,
1e-4 relative, with a floor of 1e-4 x the tensor's largest entry; gradients 1e-4 relative over an
absolute 1e-6 x their largest entry, at least 1e-6).
"""

from __future__ import annotations

import pytest
import torch
from test_ppo_packing import PAD, assert_close, attention_inputs, outputs_and_grads, two_groups

from stages.common import prefix_tree
from stages.common.errors import UserError
from stages.common.kernels.attention import register_spa_sdpa, spa_sdpa
from stages.sft import token_ce
from stages.training import sft_data
from stages.training.policy import StepPolicy, ValueModel
from stages.training.ppo_samples import collate, micro_batches, score

VOCAB = 512
#: Shorter than every row of `two_groups` (23 to 40 tokens) and than its shared prompts: the window
#: cuts rows, prompts and the nodes behind a branch.
WINDOW = 6
LAYOUT_ROWS = [[1, 2, 3, 7, 8] * 3, [1, 2, 3, 9] * 4, [1, 2, 3], [5, 6] * 7, [1, 2, 3, 7, 4] * 5,
               [1, 2, 3, 7, 8] * 3 + [9, 9, 9]]


def windowed_lm(kind: str, window: int | None, seed: int = 0):
    """A tiny random causal LM with Qwen2.5-1.5B's grouped heads in miniature (12 query heads on 2
    key/value heads: 6:1, and which query heads read which key/value head matters), whose second
    layer (Qwen2: `max_window_layers`) or first (Gemma-3: `layer_types`) slides a `window` (None:
    every layer full attention, the same weights)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    shape = {"vocab_size": VOCAB, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2,
             "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": True,
             "pad_token_id": PAD, "attn_implementation": "sdpa"}
    if kind == "qwen2":
        config = Qwen2Config(**shape, use_sliding_window=window is not None, sliding_window=window, max_window_layers=1)
        model_class = Qwen2ForCausalLM
    else:
        types = ["sliding_attention" if window else "full_attention", "full_attention"]
        config = Gemma3TextConfig(**shape, sliding_window=window or 4096, layer_types=types, query_pre_attn_scalar=8)
        model_class = Gemma3ForCausalLM
    torch.manual_seed(seed)
    model = model_class(config)
    assert ("sliding_attention" in model.config.layer_types) == (window is not None)
    assert "full_attention" in model.config.layer_types  # one layer of each: the window is per layer
    return model


@pytest.fixture(scope="module", params=["qwen2", "gemma3"])
def kind(request):
    register_spa_sdpa()  # as load_model does: packed rows take `tree_attention`
    return request.param


def test_window_mask_is_each_rows_sliding_window():
    """Within each row the tree's mask with a window is the row's own sliding-window causal mask
    (key at most `window` - 1 positions back), and nothing across rows."""
    packed = prefix_tree.pack(LAYOUT_ROWS)
    layout = prefix_tree.TreeLayout(packed.nodes)
    assert layout.positions().tolist() == packed.positions
    for window in (1, 3, 7):
        mask = layout.dense_mask(window)
        shared = torch.zeros_like(mask)
        for where in packed.where:
            index, position = torch.tensor(where), torch.arange(len(where))
            distance = position[:, None] - position[None, :]
            assert torch.equal(mask[index][:, index], (distance >= 0) & (distance < window))
            shared[index[:, None], index[None, :]] = True
        assert not mask[~shared].any()
    assert torch.equal(layout.dense_mask(10**6), layout.dense_mask())


@pytest.mark.parametrize("window", [2, WINDOW, 17])  # 1: each query only itself, a zero query gradient
@pytest.mark.parametrize("query_block", [prefix_tree.QUERY_BLOCK, 5])
def test_tree_attention_with_a_window_equals_sdpa_under_the_dense_mask(window, query_block):
    """Node by node with a window (grouped heads 6:2; nodes whole or in query blocks of 5, roots cut
    by the window or not), the outputs and input gradients of SDPA under the dense windowed mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    nodes = collate(micro_batches(two_groups(vocab=50), 4096, share=True)[0], "cpu", PAD)["layout"].nodes
    layout = prefix_tree.TreeLayout(nodes, query_block=query_block)
    inputs, weights = attention_inputs(layout.length)
    module = torch.nn.Module().train()
    module.num_key_value_groups, module.is_causal = 3, True
    dense = outputs_and_grads(lambda q, k, v: sdpa_attention_forward(
        module, q, k, v, layout.dense_mask(window)[None, None], scaling=0.3)[0], inputs, weights)
    tree = outputs_and_grads(lambda q, k, v: prefix_tree.tree_attention(
        q, k, v, layout, scaling=0.3, window=window)[0], inputs, weights)
    for ours, stock in zip([tree[0], *tree[1]], [dense[0], *dense[1]], strict=True):
        assert_close(ours, stock)


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize(("context", "length"), [(0, 9), (7, 270), (300, 5)])  # query blocks of 256: cut and whole
def test_node_attention_after_its_ancestors_keys_equals_sdpa_under_the_rows_mask(context, length, window):
    """One tree node's queries after `context` keys of its ancestors (what `spa sft`'s node
    passes compute, `stages.training.tree_passes`): the outputs and the gradients of queries, keys
    and values of SDPA under its row's causal mask (windowed where given), grouped heads 6:2."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    (q, k, v), weights = attention_inputs(context + length)
    q = q[:, :, context:].detach().requires_grad_()
    weights = weights[:, context:]
    queries, keys = torch.arange(context, context + length)[:, None], torch.arange(context + length)[None, :]
    mask = (keys <= queries) & (queries - keys < (window or 10**6))
    module = torch.nn.Module().train()
    module.num_key_value_groups, module.is_causal = 3, True
    dense = outputs_and_grads(lambda q, k, v: sdpa_attention_forward(
        module, q, k, v, mask[None, None], scaling=0.3)[0], [q, k, v], weights)
    def node(q, k, v):  # the node's own keys, and its ancestors' (none at a root)
        past = (k[:, :, :context], v[:, :, :context]) if context else (None, None)
        return prefix_tree.node_attention(q, k[:, :, context:], v[:, :, context:], *past, scaling=0.3,
                                          window=window)[0]

    ours = outputs_and_grads(node, [q, k, v], weights)
    for a, b in zip([ours[0], *ours[1]], [dense[0], *dense[1]], strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("window", [None, 3, WINDOW])
def test_flex_attention_with_a_window_matches_sdpa_per_node(window, monkeypatch):
    """FlexAttention (eager on the CPU, forward only) under the windowed mask_mod gives the per-node
    SDPA path's outputs, and reads no per-node masks (it never builds them)."""
    from torch.nn.attention.flex_attention import create_mask

    layout = collate(micro_batches(two_groups(vocab=50), 4096, share=True)[0], "cpu", PAD)["layout"]
    expanded = create_mask(layout.mask_mod(window), 1, 1, layout.length, layout.length, device="cpu")
    assert torch.equal(expanded[0, 0], layout.dense_mask(window))
    q, k, v = (x.detach() for x in attention_inputs(layout.length)[0])
    with torch.no_grad():
        nodes = prefix_tree.tree_attention(q, k, v, layout, scaling=0.3, window=window)[0]
        monkeypatch.setattr(prefix_tree.TreeLayout, "node_masks", lambda *_: pytest.fail("per-node masks built"))
        flex = prefix_tree.tree_attention(q, k, v, layout, scaling=0.3, flex=True, window=window)[0]
    assert_close(flex, nodes)


@pytest.mark.parametrize("window", [None, 1, 3, 7])
@pytest.mark.parametrize("block", [1, 3, 4, 16, prefix_tree.FLEX_BLOCK])
def test_block_mask_from_node_ranges_equals_create_block_mask(window, block, monkeypatch):
    """The block tables built from the node ranges are those `create_block_mask` derives from the
    dense T x T mask (tiles all kept, mixed, empty; a last tile the sequence's end cuts), and their
    construction evaluates no dense mask."""
    from torch.nn.attention import flex_attention

    layout = prefix_tree.TreeLayout(prefix_tree.pack(LAYOUT_ROWS).nodes)
    dense, tiles = layout.dense_mask(window), -(-layout.length // block)
    padded = torch.nn.functional.pad(dense, (0, tiles * block - layout.length, 0, tiles * block - layout.length))
    assert torch.equal(layout.tile_counts(window, block), padded.view(tiles, block, tiles, block).sum((1, 3)))
    expected = flex_attention.create_block_mask(layout.mask_mod(window), 1, None, layout.length, layout.length,
                                                device="cpu", BLOCK_SIZE=block)
    monkeypatch.setattr(flex_attention, "create_mask", lambda *_, **__: pytest.fail("dense mask built"))
    ours = layout.block_mask(window, block)
    for table in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                  "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(ours, table), getattr(expected, table)), table
    assert ours.seq_lengths == expected.seq_lengths and ours.BLOCK_SIZE == expected.BLOCK_SIZE
    assert layout.block_mask(window, block) is ours  # built once, read by every layer


def test_packed_attention_refuses_what_it_cannot_compute():
    """A model whose attention soft-caps its scores (Gemma-2, on SDPA) or has sinks would lose them
    on the packed path: refused, in one line."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    register_spa_sdpa()
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, attn_implementation="sdpa")
    packed = prefix_tree.pack([[1, 2, 3], [1, 2, 4]])
    inputs = {"input_ids": torch.tensor([packed.ids]), "position_ids": torch.tensor([packed.positions]),
              "attention_mask": prefix_tree.placeholder_mask(len(packed)),
              "packed_layout": prefix_tree.TreeLayout(packed.nodes)}
    with pytest.raises(UserError, match="share_prefix") as err:
        Gemma2ForCausalLM(config)(**inputs)
    assert "\n" not in str(err.value) and config.attn_logit_softcapping
    q = k = v = torch.zeros(1, 2, len(packed), 8)
    with pytest.raises(UserError, match="share_prefix"):
        spa_sdpa(torch.nn.Module(), q, k, v, None, packed_layout=inputs["packed_layout"], s_aux=torch.zeros(2))


def scores(forward, field: str, share: bool):
    samples = two_groups(VOCAB)
    score(forward, [(micro, 1.0) for micro in micro_batches(samples, 4096, share=share)], (field,), "cpu", PAD)
    return [getattr(s, field) for s in samples]


@pytest.mark.parametrize("field", ["old_logprobs", "values"])
def test_packed_scores_equal_unpacked_with_windows_and_grouped_heads(kind, field):
    """A whole model with grouped heads and a sliding-window layer: the packed log-probs and values
    are the unpacked rows' (whose masks transformers builds with the window), which the window
    changes (the same weights with full attention score otherwise)."""
    def forward(window):
        lm = windowed_lm(kind, window, seed=1)
        if field == "values":
            critic = ValueModel(lm)
            torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(2))
            return critic
        return StepPolicy(lm, temperature=0.7)

    windowed = forward(WINDOW)
    unpacked, packed = scores(windowed, field, share=False), scores(windowed, field, share=True)
    for a, b in zip(unpacked, packed, strict=True):
        assert_close(b, a)
    full = scores(forward(None), field, share=False)
    floor = 1e-4 * max(float(a.abs().max()) for a in unpacked)  # `assert_close`'s, which the window must exceed
    assert max(float((a - b).abs().max()) for a, b in zip(unpacked, full, strict=True)) > 10 * floor


@pytest.mark.parametrize("window", [None, WINDOW])
def test_packed_gradients_equal_unpacked_with_windows_and_grouped_heads(kind, window):
    """The weighted log-probs of every step, unpacked in one micro-batch and packed over several
    (gradient accumulation): the same gradient for every parameter of the 6:1 model, with full
    attention and with a sliding-window layer."""
    policy = StepPolicy(windowed_lm(kind, window, seed=3), temperature=1.0)

    def gradients(share: bool, budget: int) -> dict[str, torch.Tensor]:
        samples = two_groups(VOCAB)
        g = torch.Generator().manual_seed(4)
        for s in samples:  # each step's weight
            s.advantages = torch.randn(s.steps, generator=g)
        policy.zero_grad()
        micros = micro_batches(samples, budget, share)
        for rows in micros:
            logprobs, _, _ = policy(**collate(rows, "cpu", PAD))
            (logprobs * torch.cat([s.advantages for row in rows for s in row])).sum().backward()
        assert len(micros) == (1 if budget > 1000 else 2)
        return {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}

    unpacked, packed = gradients(share=False, budget=4096), gradients(share=True, budget=60)
    assert unpacked.keys() == packed.keys() and len(unpacked) > 10
    for name in unpacked:
        scale = max(1.0, unpacked[name].abs().max().item())
        torch.testing.assert_close(packed[name], unpacked[name], rtol=1e-4, atol=1e-6 * scale, msg=name)


def test_packed_sft_loss_equals_each_row_alone_with_windows(kind):
    """`spa sft`'s token losses of rows packed as a prefix tree (turn rows of one trajectory, longer
    than the window) are each row's alone."""
    policy = StepPolicy(windowed_lm(kind, WINDOW, seed=5), temperature=1.0)
    rows = [s.ids.tolist() for s in two_groups(VOCAB)]
    examples = [sft_data.Example(str(i), ids, [0] + [1] * (len(ids) - 1)) for i, ids in enumerate(rows)]
    packed = token_ce(policy, sft_data.collate(examples, share=True))
    alone = torch.cat([token_ce(policy, sft_data.collate([example])) for example in examples])
    assert len(packed) == sum(len(ids) - 1 for ids in rows)
    assert_close(packed, alone)
