"""From played episodes to PPO samples, and the passes over them.

An episode (`stages.agent.episode.Episode`, token-in/token-out) becomes a `Sample`: its token
ids, the positions that are PPO steps (the loss mask), its rewards on those steps; later phases
fill in old log-probs, values, advantages and returns. Samples are grouped into micro-batches of
bounded padded size (`micro_batches`) and collated into right-padded tensors (`collate`); every
loss is a sum over steps divided by the mini-batch's step count, so the grouping never changes it.

Over several ranks (`rank_shares`, `rank_micro_batches`) each mini-batch is split into equal
parts, one per rank, balanced by tokens; every rank makes the same number of passes (fillers of
weight 0 where its part needs fewer), since ZeRO's collectives run in every backward (and, under
ZeRO-3, in every forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stages.agent import prompts
from stages.agent.context import common_prefix_len
from stages.common.config import PPOConfig
from stages.training import ppo_algos as algos


@dataclass
class Sample:
    """One kept episode as PPO sees it. Step tensors have one entry per loss-mask position.

    Step s is the token at ``positions[s]`` (an index into ``ids``), predicted from the position
    before it. Later phases fill in old log-probs, values, advantages and returns.
    """

    ids: torch.Tensor  # [n] the episode's token ids
    positions: torch.Tensor  # [S]
    sampled: torch.Tensor  # [S] bool: a token the sampler produced (not env text)
    sampler_logprobs: torch.Tensor | None  # [S] the sampler's log-probs (0 on env text)
    rewards: torch.Tensor  # [S] the score on the last sampled token
    turn_rewards: torch.Tensor  # [S] each turn's reward + penalty on the turn's last token
    turn_ends: torch.Tensor  # [S] bool
    score: float
    group: int
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def steps(self) -> int:
        return len(self.positions)


def system_prompt_length(tokenizer: Any, token_ids: list[int]) -> int:
    """How many leading tokens of an episode are the system prompt (excluded by loss_mask="all").

    The system message is rendered alone through the chat template; the common prefix of its
    tokens and the episode's is the system part (robust to templates that render a lone system
    message slightly differently).
    """
    text = tokenizer.apply_chat_template([{"role": "system", "content": prompts.SYSTEM_PROMPT}], tokenize=False)
    return common_prefix_len(tokenizer.encode(text, add_special_tokens=False), token_ids)


def to_sample(episode: Any, loss_mask: str, system_length: int) -> Sample:
    """The PPO view of a finished episode; its score sits on its last sampled token."""
    ids = torch.tensor(episode.token_ids, dtype=torch.long)
    response = torch.tensor(episode.response_mask, dtype=torch.bool)
    mask = response.clone()
    if loss_mask == "all":
        mask[system_length:] = True
    mask[0] = False  # nothing predicts the first token
    positions = mask.nonzero().squeeze(-1)
    sampled = response[positions]
    rewards = torch.zeros(len(positions))
    rewards[int(sampled.nonzero().max())] = episode.total_reward
    turn_rewards, turn_ends = _turn_rewards(episode, positions)
    logprobs = None
    if episode.logprobs is not None:
        logprobs = torch.tensor(episode.logprobs, dtype=torch.float32)[positions]
    return Sample(ids, positions, sampled, logprobs, rewards, turn_rewards, turn_ends,
                  float(episode.total_reward), int(episode.group))


def _turn_rewards(episode: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each turn's env reward plus its format penalty, on the step of the turn's last sampled token."""
    step_of = {int(p): s for s, p in enumerate(positions)}
    rewards = torch.zeros(len(positions))
    ends = torch.zeros(len(positions), dtype=torch.bool)
    carried = 0.0  # an empty completion's reward goes to the next turn that has tokens
    for turn, (start, end) in zip(episode.turns, episode.turn_spans, strict=True):
        carried += turn.reward + turn.penalty
        if end > start:
            step = step_of[end - 1]
            rewards[step] += carried
            ends[step] = True
            carried = 0.0
    if carried:
        rewards[ends.nonzero().max()] += carried
    return rewards, ends


def padded(samples: list[Sample], field: str) -> torch.Tensor:
    """A ``[B, S_max]`` float tensor of one step field, zero-padded."""
    return nn.utils.rnn.pad_sequence([getattr(s, field).float() for s in samples], batch_first=True)


def step_mask(samples: list[Sample]) -> torch.Tensor:
    """``[B, S_max]``: 1 on each sample's steps, 0 on padding."""
    return nn.utils.rnn.pad_sequence([torch.ones(s.steps) for s in samples], batch_first=True)


def unpad(samples: list[Sample], field: str, values: torch.Tensor) -> None:
    for row, sample in enumerate(samples):
        setattr(sample, field, values[row, : sample.steps].clone())


def micro_batches(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """Groups of samples whose padded size (rows x longest) fits ``token_budget``; a sample longer
    than the budget goes alone. Samples are grouped by length (shortest first) so that little
    compute goes to padding; every loss is a sum over tokens, so the grouping never changes it."""
    batches: list[list[Sample]] = []
    current: list[Sample] = []
    for sample in sorted(samples, key=lambda s: len(s.ids)):  # sorted() is stable: deterministic
        if current and len(sample.ids) * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(sample)
    if current:
        batches.append(current)
    return batches


def collate(samples: list[Sample], device: Any, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids and attention mask, and for every step its row, the position that predicts
    it (``cols``) and its token (``targets``)."""
    ids = nn.utils.rnn.pad_sequence([s.ids for s in samples], batch_first=True, padding_value=pad_id)
    attention = nn.utils.rnn.pad_sequence([torch.ones_like(s.ids) for s in samples], batch_first=True)
    rows = torch.cat([torch.full_like(s.positions, i) for i, s in enumerate(samples)])
    positions = torch.cat([s.positions for s in samples])
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device), "rows": rows.to(device),
            "cols": (positions - 1).to(device), "targets": ids[rows, positions].to(device)}


def flat(samples: list[Sample], field: str, device: Any) -> torch.Tensor:
    return torch.cat([getattr(s, field) for s in samples]).to(device)


# ---- the phases of a step ------------------------------------------------------------------------


def rank_shares(samples: list[Sample], mini_batch: int, world: int) -> list[list[list[int]]]:
    """``shares[m][r]``: the indices of the samples of mini-batch m (``mini_batch`` consecutive
    samples, in order) that rank r trains, ``mini_batch / world`` each. The longest sample goes
    first, to the rank with the fewest tokens so far (ties: the lower rank), so every rank computes
    the same plan; within a part the indices are in order."""
    per_rank = mini_batch // world
    shares = []
    for start in range(0, len(samples), mini_batch):
        parts: list[list[int]] = [[] for _ in range(world)]
        load = [0] * world
        for index in sorted(range(start, min(start + mini_batch, len(samples))),
                            key=lambda i: (-len(samples[i].ids), i)):
            rank = min((r for r in range(world) if len(parts[r]) < per_rank), key=lambda r: (load[r], r))
            parts[rank].append(index)
            load[rank] += len(samples[index].ids)
        shares.append([sorted(part) for part in parts])
    return shares


def rank_micro_batches(parts: list[list[Sample]], token_budget: int, rank: int) -> list[tuple[list[Sample], float]]:
    """Rank `rank`'s micro-batches of ``parts[rank]`` as (samples, weight 1.0), then fillers (its
    first micro-batch again, weight 0.0) up to the most micro-batches any rank has: every rank
    makes the same number of passes."""
    plans = [micro_batches(part, token_budget) for part in parts]
    mine = plans[rank]
    return [(micro, 1.0) for micro in mine] + [(mine[0], 0.0)] * (max(len(p) for p in plans) - len(mine))


@torch.no_grad()
def score(forward: Any, micros: list[tuple[list[Sample], float]], field: str, device: Any, pad_id: int) -> None:
    """Fill ``field`` of every sample of `micros` (from `rank_micro_batches`) with ``forward``'s
    output at its steps: log-probs from a policy, values from the critic (which takes no
    ``targets``). Fillers (weight 0) run and are discarded."""
    for micro, weight in micros:
        batch = collate(micro, device, pad_id)
        if field == "values":
            batch.pop("targets")
        out = forward(**batch)
        out = out[0] if isinstance(out, tuple) else out
        if weight == 0:
            continue
        for sample, part in zip(micro, out.float().cpu().split([s.steps for s in micro]), strict=True):
            setattr(sample, field, part)


def compute_advantages(samples: list[Sample], ppo: PPOConfig) -> None:
    """Advantages and returns of every sample (``returns`` only when there is a critic)."""
    mask = step_mask(samples)
    if ppo.advantage == "grpo":
        scores = torch.tensor([s.score for s in samples])
        groups = torch.tensor([s.group for s in samples])
        unpad(samples, "advantages", algos.group_advantages(scores, groups)[:, None] * mask)
        return
    values = padded(samples, "values")
    if ppo.advantage == "gae":
        advantages, returns = algos.masked_gae(padded(samples, "rewards"), values, mask, ppo.gamma, ppo.lam)
    else:
        advantages, returns = algos.bilevel_gae(padded(samples, "turn_rewards"), values, mask,
                                                padded(samples, "turn_ends"), ppo.gamma, ppo.lam, ppo.turn_gamma)
    unpad(samples, "advantages", algos.masked_whiten(advantages, mask))
    unpad(samples, "returns", returns)
