"""A micro-batch of prefix-tree-packed rows trained one tree node at a time (`sft.share_prefix` on
a CPU).

Packed as one sequence (`stages.common.prefix_tree`), a micro-batch computes each shared token
once but holds the activations of the whole tree until its backward: several rows' worth. Here the
tree is walked depth first instead. Each node is one forward pass over its own tokens whose
attention reads its ancestors' keys and values as they are (`prefix_tree.NodePass`, no cache
concatenating them with the node's own); its keys and values go on to its children as leaf
tensors, whose gradients the children's backward passes fill; once they are done, the
node's own backward carries its loss and those gradients through its layers, and lets its
activations go. So the activations held at once are those of one root-to-leaf path, a single
row's at most (as many as training each row alone holds), while every shared token is computed
once: the rows' losses and gradients are those of the packed pass (tests/test_sft.py).

`applies` says where it runs: the plain-torch engine (DeepSpeed's engines reduce and scale each
backward pass themselves), without gradient checkpointing (a checkpointed layer runs its
attention again in the backward, which `NodePass` would take for the next layer's), on a model
without sliding-window layers (`node_attention` computes a window, tested alone, but no test trains
such a model node by node), on the CPU (on CUDA one compiled FlexAttention call over the whole
tree is faster than many small passes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stages.common.prefix_tree import NodePass
from stages.training.sft_data import collate


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
    return _Walk(engine, collate(examples, share=True), weights_of, scale).run()


class _Walk:
    """One micro-batch's depth-first walk. A class rather than a recursive closure: a closure that
    calls itself is a reference cycle, which would keep the engine (weights, gradients, optimizer
    state) alive after training until Python's cycle collector happened to run."""

    def __init__(self, engine, batch: dict, weights_of: Callable[[torch.Tensor], torch.Tensor], scale: float):
        self.engine, self.scale = engine, scale
        self.batch = batch  # the packed tree, its trained positions, targets and rows (`sft_data.collate`)
        self.nodes = batch["layout"].nodes
        node_of = torch.repeat_interleave(torch.arange(len(self.nodes)),
                                          torch.tensor(batch["layout"].sizes))[batch["keep"]]
        # The weights see every trained token of the micro-batch at once (a row's tokens lie in several nodes).
        weights = weights_of(batch["rows"])
        self.targets = [(batch["keep"][node_of == n] - start, batch["targets"][node_of == n], weights[node_of == n])
                        for n, (start, _, _) in enumerate(self.nodes)]
        self.children: list[list[int]] = [[] for _ in self.nodes]
        for node, (_, _, parent) in enumerate(self.nodes):
            if parent >= 0:
                self.children[parent].append(node)
        self.needed = [len(cols) > 0 for cols, _, _ in self.targets]  # the node or a descendant has trained tokens
        for node in reversed(range(len(self.nodes))):  # depth first: descendants come after their node
            self.needed[node] = self.needed[node] or any(self.needed[c] for c in self.children[node])
        self.loss = 0.0

    def run(self) -> float:
        for root, (_, _, parent) in enumerate(self.nodes):
            if parent < 0 and self.needed[root]:
                self.visit(root, None)
        return self.loss

    def visit(self, node: int, context: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        start, end, _ = self.nodes[node]
        cols, ids, node_weights = self.targets[node]
        node_pass = NodePass(context)
        logprobs, _, _ = self.engine(input_ids=self.batch["input_ids"][:, start:end], attention_mask=None,
                                     rows=torch.zeros_like(cols), cols=cols, targets=ids,
                                     position_ids=self.batch["position_ids"][:, start:end], node=node_pass)
        own = node_pass.own
        kids = [child for child in self.children[node] if self.needed[child]]
        leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in own] if kids else []
        if kids:
            path = [(torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
                    for (pk, pv), (k, v) in zip(context, leaves, strict=True)] if context else leaves
            for child in kids:
                self.visit(child, path)
            del path
        ce = -logprobs
        total = (ce * node_weights).sum() * self.scale
        for (k, v), (leaf_k, leaf_v) in zip(own, leaves):  # no leaves: no descendants
            if leaf_k.grad is not None:  # what the descendants' losses ask of this node's keys and values
                total = total + (k * leaf_k.grad).sum() + (v * leaf_v.grad).sum()
        if total.requires_grad:
            self.engine.backward(total)
        self.loss += ce.sum().item() * self.scale
