"""The two networks PPO trains, as the trainer sees them (and SFT's, the first of them).

* `StepPolicy` wraps the actor (a causal LM): log-probs (and entropies) of given tokens at given
  positions, at the sampling temperature.
* `ValueModel` is the critic: the same kind of network with its LM head replaced by a linear
  value head. With ``ppo.critic: shared`` there is no second network: `StepPolicy` carries the
  value head itself and returns values from the same pass (`ppo` passes ``with_values``).

Both run their heads only at the requested positions (``rows``, ``cols``), so prompt and
environment tokens cost no vocabulary projection, and take ``position_ids`` and the ``layout`` of
prefix-tree-packed rows (`stages.training.ppo_samples.collate`).

`spa sft` trains a `StepPolicy` at temperature 1 too: its token cross-entropy is minus the
log-probs, so SFT and PPO share one LM-head path. That path runs the head over `head_chunk`
positions at a time (`head_logprobs`), so the logits of a whole micro-batch never exist at once,
in the forward pass or the backward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stages.training import ppo_algos as algos

#: The size of one fp32 ``[positions, vocab]`` tensor of a chunk of positions: the LM head runs
#: over that many positions at a time (341 at SmolLM2's 49k vocabulary, 110 at Qwen2.5's 152k).
#: A chunk's backward holds a few such tensors (logits, log-softmax, their gradient); smaller
#: chunks save little more and recompute the head's weight cast (under autocast) more often.
HEAD_CHUNK_BYTES = 64 * 2**20


class StepPolicy(nn.Module):
    """The actor (or SFT's model) as the trainer sees it: log-probs (and entropies) of given tokens at
    given positions.

    The LM head runs only on the requested positions, a chunk of them at a time (`head_logprobs`),
    when the model's logits are a plain linear map of its last hidden state (checked once on a
    probe input); otherwise the model computes the logits of the requested columns itself, whole.
    Logits are divided by the sampling temperature: the log-probs are those of the distribution
    the sampler drew from. ``value_lr`` adds a value head on the last hidden state (a shared-trunk
    critic) that learns at that rate (`optimizer_groups`).
    """

    def __init__(self, causal_lm: nn.Module, temperature: float, value_lr: float | None = None):
        super().__init__()
        self.lm = causal_lm
        self.temperature = temperature
        self.plain_head = _head_is_plain(causal_lm)
        self.value_head = _value_head(causal_lm) if value_lr is not None else None
        self.value_lr = value_lr

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor,
                cols: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False, with_values: bool = False,
                position_ids: torch.Tensor | None = None, layout: Any = None, node: Any = None):
        """(log-probs, entropies or None, values or None) at the positions ``(rows, cols)``; with a
        ``node`` (a `stages.common.prefix_tree.NodePass`) the tokens are one prefix-tree node after
        the ancestors' keys it holds, and it gains theirs."""
        inputs = _model_inputs(input_ids, attention_mask, position_ids, layout, node)
        if self.plain_head:
            hidden = self.lm.base_model(**inputs).last_hidden_state[rows, cols]
            head = self.lm.get_output_embeddings()
            logprobs, entropy = head_logprobs(head, hidden, targets, self.temperature, with_entropy)
        else:
            # Only the requested columns: each row's logits at every column any row asks for.
            columns, column_of = torch.unique(cols, return_inverse=True)
            out = self.lm(**inputs, logits_to_keep=columns, output_hidden_states=with_values)
            logprobs, entropy = _scores(out.logits[rows, column_of], targets, self.temperature, with_entropy)
            hidden = out.hidden_states[-1][rows, cols] if with_values else None
        values = self.value_head(hidden).squeeze(-1).float() if with_values else None
        return logprobs, entropy, values

    def optimizer_groups(self, lr: float) -> list[dict]:
        """The trainable weights by learning rate: the value head's own, the rest at `lr`."""
        head = {id(p) for p in self.value_head.parameters()} if self.value_head is not None else set()
        groups = [{"params": [p for p in self.parameters() if p.requires_grad and id(p) not in head], "lr": lr}]
        if head:
            groups.append({"params": list(self.value_head.parameters()), "lr": self.value_lr})
        return groups


class ValueModel(nn.Module):
    """The critic: a causal LM's transformer body with a linear value head on its last hidden state.

    ``forward(input_ids, attention_mask, rows, cols)`` returns the values at positions
    ``(rows, cols)`` only, shape ``[N]`` (``targets``, which the policy scores, is ignored).
    """

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.body = causal_lm.base_model
        self.value_head = _value_head(causal_lm)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor,
                cols: torch.Tensor, position_ids: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, layout: Any = None) -> torch.Tensor:
        hidden = self.body(**_model_inputs(input_ids, attention_mask, position_ids, layout)).last_hidden_state
        return self.value_head(hidden[rows, cols]).squeeze(-1).float()


def head_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` (and the entropies) under ``head(hidden) / temperature``, for
    ``hidden`` ``[N, hidden_size]``, `head_chunk` positions at a time.

    With gradients and more than one chunk, each chunk is checkpointed: its forward keeps only its
    inputs, and its backward recomputes its logits, so one chunk's vocabulary-sized tensors exist
    at a time in either pass, at the price of a second head matmul per chunk. One chunk is not
    recomputed: it keeps what the unchunked computation keeps, no more than a chunk."""
    chunk = head_chunk(head.out_features)
    recompute = torch.is_grad_enabled() and hidden.shape[0] > chunk
    score = partial(checkpoint, _head_scores, use_reentrant=False) if recompute else _head_scores
    pieces = [score(head, h, t, temperature, with_entropy)
              for h, t in zip(hidden.split(chunk), targets.split(chunk), strict=True)]
    logprobs = torch.cat([lp for lp, _ in pieces])
    return logprobs, torch.cat([e for _, e in pieces]) if with_entropy else None


def head_chunk(vocab: int) -> int:
    """Positions per chunk of `head_logprobs`: one fp32 ``[chunk, vocab]`` tensor in `HEAD_CHUNK_BYTES`."""
    return max(1, HEAD_CHUNK_BYTES // (4 * vocab))


def _head_scores(head, hidden, targets, temperature, with_entropy):
    return _scores(head(hidden), targets, temperature, with_entropy)


def _scores(logits, targets, temperature, with_entropy):
    logits = logits.float()
    if temperature != 1.0:  # x / 1 is x exactly: at 1 (SFT's, and the paper's PPO) skip a vocabulary-wide pass
        logits = logits / temperature
    if with_entropy:
        return algos.logprobs_and_entropy(logits, targets)
    return algos.logprobs_from_logits(logits, targets), None


def _model_inputs(input_ids, attention_mask, position_ids, layout, node=None) -> dict:
    """The model call's arguments; a prefix-tree-packed batch's ``layout`` reaches its attention
    as ``packed_layout`` (`stages.common.kernels.attention.spa_sdpa`), a node pass's ``node``
    (`stages.training.tree_passes`) as ``tree_node``."""
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              "use_cache": False}
    if node is not None:
        inputs["tree_node"] = node
    return inputs | {"packed_layout": layout} if layout is not None else inputs


def _value_head(causal_lm: nn.Module) -> nn.Linear:
    """A linear map of the last hidden state to one number, zero-initialised: V = 0 at first, no
    arbitrary initial baseline."""
    weight = next(causal_lm.parameters())
    head = nn.Linear(causal_lm.config.hidden_size, 1, dtype=weight.dtype, device=weight.device)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


@torch.no_grad()
def _head_is_plain(causal_lm: nn.Module) -> bool:
    head = causal_lm.get_output_embeddings()
    if head is None:
        return False
    probe = torch.arange(1, 9, device=next(causal_lm.parameters()).device).unsqueeze(0)
    full = causal_lm(input_ids=probe).logits[0]
    hidden = causal_lm.base_model(input_ids=probe).last_hidden_state[0]
    # Loose enough for bf16 rounding, far tighter than any logit transform (soft-capping, scaling).
    return torch.allclose(head(hidden).float(), full.float(), atol=1e-2, rtol=1e-2)
