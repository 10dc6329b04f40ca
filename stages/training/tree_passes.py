"""A micro-batch of prefix-tree-packed rows trained one tree node at a time (`sft.share_prefix` on
a CPU).

Packed as one sequence (`stages.common.prefix_tree`), a micro-batch computes each shared token
once but holds the activations of the whole tree until its backward: several rows' worth. Here the
tree is walked depth first instead. Each node is one forward pass over its own tokens that reads
its ancestors' keys and values from a KV cache; its keys and values go on to its children as
leaf tensors, whose gradients the children's backward passes fill; once they are done, the
node's own backward carries its loss and those gradients through its layers, and lets its
activations go. So the activations held at once are those of one root-to-leaf path, a single
row's at most (as many as training each row alone holds), while every shared token is computed
once: the rows' losses and gradients are those of the packed pass (tests/test_sft.py).

`applies` says where it runs: the plain-torch engine (DeepSpeed's engines reduce and scale each
backward pass themselves), without gradient checkpointing (transformers keeps no cache in a
checkpointed training pass), on a model without sliding-window layers (their cache keeps only the
window), on the CPU (on CUDA one compiled FlexAttention call over the whole tree is faster than
many small passes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stages.common import prefix_tree


def applies(device: str, zero_stage: int, gradient_checkpointing: bool, model_config) -> bool:
    """Whether `backward` can train this run's shared micro-batches (see the module docstring)."""
    text = model_config.get_text_config()
    types = getattr(text, "layer_types", None)
    windowed = any(t != "full_attention" for t in types) if types else getattr(text, "sliding_window", None)
    return device == "cpu" and zero_stage == 0 and not gradient_checkpointing and not windowed


def backward(engine, examples: list, weights_of: Callable[[torch.Tensor], torch.Tensor], scale: float) -> float:
    """Forward and backward passes of one micro-batch (`examples`, `sft_data.Example` rows) node by
    node; the gradient is that of ``sum(token_ce * weights_of(rows)) * scale``, where ``rows``
    names each trained token's row (index into `examples`), as `sft_data.collate` does. Returns
    the summed cross-entropy times `scale`."""
    packed = prefix_tree.pack([ex.input_ids for ex in examples])
    targets = _targets_by_node(packed, examples)
    # The weights see every trained token of the micro-batch at once (a row's tokens lie in several nodes).
    weights = weights_of(torch.cat([rows for _, _, rows in targets])).split([len(rows) for _, _, rows in targets])
    children: list[list[int]] = [[] for _ in packed.nodes]
    for node, (_, _, parent) in enumerate(packed.nodes):
        if parent >= 0:
            children[parent].append(node)
    needed = [len(cols) > 0 for cols, _, _ in targets]  # the node or a descendant has trained tokens
    for node in reversed(range(len(packed.nodes))):  # depth first: descendants come after their node
        needed[node] = needed[node] or any(needed[c] for c in children[node])
    loss = 0.0

    def visit(node: int, context: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        nonlocal loss
        from transformers import DynamicCache

        start, end, _ = packed.nodes[node]
        cols, ids, _ = targets[node]
        cache = DynamicCache(ddp_cache_data=context) if context else DynamicCache()
        past = cache.get_seq_length()
        logprobs, _, _ = engine(input_ids=torch.tensor([packed.ids[start:end]]), attention_mask=None,
                                rows=torch.zeros_like(cols), cols=cols, targets=ids,
                                position_ids=torch.tensor([packed.positions[start:end]]), cache=cache)
        own = [(layer.keys[:, :, past:], layer.values[:, :, past:]) for layer in cache.layers]
        del cache
        kids = [child for child in children[node] if needed[child]]
        leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in own] if kids else []
        if kids:
            path = [(torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
                    for (pk, pv), (k, v) in zip(context, leaves, strict=True)] if context else leaves
            for child in kids:
                visit(child, path)
            del path
        ce = -logprobs
        total = (ce * weights[node]).sum() * scale
        for (k, v), (leaf_k, leaf_v) in zip(own, leaves):  # no leaves: no descendants
            if leaf_k.grad is not None:  # what the descendants' losses ask of this node's keys and values
                total = total + (k * leaf_k.grad).sum() + (v * leaf_v.grad).sum()
        if total.requires_grad:
            engine.backward(total)
        loss += ce.sum().item() * scale

    for root, (_, _, parent) in enumerate(packed.nodes):
        if parent < 0 and needed[root]:
            visit(root, [])
    return loss


def _targets_by_node(packed: prefix_tree.PackedRows, examples: list) -> list[tuple[torch.Tensor, ...]]:
    """Per node, the trained tokens whose logits its tokens give: (the positions within the node,
    the target ids, the rows), in `collate`'s order within the node."""
    node_of = [0] * len(packed)
    for node, (start, end, _) in enumerate(packed.nodes):
        node_of[start:end] = [node] * (end - start)
    found: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in packed.nodes]
    for r, (ex, where) in enumerate(zip(examples, packed.where, strict=True)):
        for t in range(1, len(ex)):
            if ex.mask[t]:
                at = where[t - 1]
                cols, ids, rows = found[node_of[at]]
                cols.append(at - packed.nodes[node_of[at]][0])
                ids.append(ex.input_ids[t])
                rows.append(r)
    return [tuple(torch.tensor(x, dtype=torch.long) for x in lists) for lists in found]
