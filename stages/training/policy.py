"""The two networks PPO trains, as the trainer sees them.

* `StepPolicy` wraps the actor (a causal LM): log-probs (and entropies) of given tokens at given
  positions, at the sampling temperature.
* `ValueModel` is the critic: the same kind of network with its LM head replaced by a linear
  value head.

Both run their heads only at the requested positions (``rows``, ``cols``), so prompt and
environment tokens cost no vocabulary projection, and take ``position_ids`` with a 4D attention
mask for packed rows (`stages.training.ppo_samples.pack_row`).
"""

from __future__ import annotations

import torch
from torch import nn

from stages.training import ppo_algos as algos


class StepPolicy(nn.Module):
    """The actor as the trainer sees it: log-probs (and entropies) of given tokens at given positions.

    The LM head runs only on the requested positions when the model's logits are a plain linear
    map of its last hidden state (checked once on a probe input); otherwise the full logits are
    computed and indexed. Logits are divided by the sampling temperature: the log-probs are those
    of the distribution the sampler drew from.
    """

    def __init__(self, causal_lm: nn.Module, temperature: float):
        super().__init__()
        self.lm = causal_lm
        self.temperature = temperature
        self.plain_head = _head_is_plain(causal_lm)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor,
                cols: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False,
                position_ids: torch.Tensor | None = None):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "use_cache": False}
        if self.plain_head:
            hidden = self.lm.base_model(**inputs).last_hidden_state
            logits = self.lm.get_output_embeddings()(hidden[rows, cols])
        else:
            logits = self.lm(**inputs).logits[rows, cols]
        logits = logits.float() / self.temperature
        entropy = algos.entropy_from_logits(logits) if with_entropy else None
        return algos.logprobs_from_logits(logits, targets), entropy


class ValueModel(nn.Module):
    """The critic: a causal LM's transformer body with a linear value head on its last hidden state.

    ``forward(input_ids, attention_mask, rows, cols)`` returns the values at positions
    ``(rows, cols)`` only, shape ``[N]``.
    """

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.body = causal_lm.base_model
        weight = next(causal_lm.parameters())
        self.value_head = nn.Linear(causal_lm.config.hidden_size, 1, dtype=weight.dtype, device=weight.device)
        nn.init.zeros_(self.value_head.weight)  # V = 0 at first: no arbitrary initial baseline
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor,
                cols: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).last_hidden_state
        return self.value_head(hidden[rows, cols]).squeeze(-1).float()


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
