"""From played episodes to PPO samples, and the passes over them.

An episode (`stages.agent.episode.Episode`, token-in/token-out) becomes a `Sample`: its token
ids, the positions that are PPO steps (the loss mask), its rewards on those steps; later phases
fill in old log-probs, values, advantages and returns. Samples are grouped into micro-batches of
bounded padded size (`micro_batches`) and collated into right-padded tensors (`collate`); every
loss is a weighted sum over steps with the normaliser of the whole mini-batch (`loss_agg`), so the
grouping never changes it.

Packing (`ppo.pack_groups`): the episodes of a group play one puzzle, so they share their first
prompt (system prompt, instruction, first state: most of a one-turn episode's tokens). Their
samples then go into one sequence, the shared prefix once and each episode's own tokens after it,
with an attention mask and position ids that give every token exactly its own episode's context
(`pack_row`): the actor's, critic's and reference's passes compute the prefix once per group
instead of once per episode, and their outputs and gradients are those of the unpacked samples.

Over several ranks (`rank_shares`, `rank_micro_batches`) each mini-batch is split into equal
parts, one per rank, balanced by tokens (packing joins the group-mates within a part); every rank
makes the same number of passes (fillers of weight 0 where its part needs fewer), since ZeRO's
collectives run in every backward (and, under ZeRO-3, in every forward).
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
    turn_rewards: torch.Tensor  # [S] each turn's reward + penalty + state reward on the turn's last token
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
    """Each turn's env reward, format penalty and state reward, on the step of the turn's last sampled
    token: the reward of the turn it judges (VAGEN's turn-level reward). They sum to the score."""
    step_of = {int(p): s for s, p in enumerate(positions)}
    rewards = torch.zeros(len(positions))
    ends = torch.zeros(len(positions), dtype=torch.bool)
    carried = 0.0  # an empty completion's reward goes to the next turn that has tokens
    for turn, (start, end) in zip(episode.turns, episode.turn_spans, strict=True):
        carried += turn.reward + turn.penalty + turn.state_reward
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


def micro_batches(samples: list[Sample], token_budget: int, pack: bool = False) -> list[list[list[Sample]]]:
    """The passes over `samples`: micro-batches of rows, each row a list of samples.

    Without `pack` every row is one sample. With `pack` the samples of one group share a row
    (`pack_row`): their first prompt, the same for the whole group, is computed once. A row's cost
    is its packed length; rows are grouped by length (shortest first) so that little compute goes
    to padding, and a micro-batch's padded size (rows x longest) stays within ``token_budget`` (a
    group too long for it is split over several rows; one sample longer than it goes alone). Every
    loss is a sum over tokens, so neither the packing nor the grouping changes it.
    """
    rows: list[list[Sample]] = []
    for group in _groups(samples) if pack else [[sample] for sample in samples]:
        row: list[Sample] = []
        for sample in group:
            if row and packed_length([*row, sample]) > token_budget:
                rows.append(row)
                row = []
            row.append(sample)
        rows.append(row)
    batches: list[list[list[Sample]]] = []
    current: list[list[Sample]] = []
    for row in sorted(rows, key=packed_length):  # sorted() is stable: deterministic
        if current and packed_length(row) * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    return batches


def _groups(samples: list[Sample]) -> list[list[Sample]]:
    by_group: dict[int, list[Sample]] = {}
    for sample in samples:
        by_group.setdefault(sample.group, []).append(sample)
    return list(by_group.values())


def shared_prefix(row: list[Sample]) -> int:
    """How many leading tokens every sample of a row shares (0 for one sample), leaving each at
    least one token of its own."""
    if len(row) == 1:
        return 0
    first = row[0].ids.tolist()
    shared = min(len(s.ids) for s in row) - 1
    for sample in row[1:]:
        shared = min(shared, common_prefix_len(first, sample.ids.tolist()))
    return shared


def packed_length(row: list[Sample]) -> int:
    shared = shared_prefix(row)
    return shared + sum(len(s.ids) - shared for s in row)


def pack_row(row: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One sequence for the samples of `row`: the shared prefix once, then each sample's own tokens.

    Returns the token ids ``[T]``, the position ids ``[T]`` (each sample's tokens continue the
    prefix's positions, as in its own sequence), the attention mask ``[T, T]`` (True: may attend;
    the prefix is causal, each sample's tokens see the prefix and their own earlier tokens, never
    another sample's), and per sample the row index of each of its tokens. Every token therefore
    has exactly the context and position it has in its own sequence, so the outputs are those of
    the unpacked samples.
    """
    shared = shared_prefix(row)
    ids = [row[0].ids[:shared]]
    where, offset = [], shared
    for sample in row:
        own = len(sample.ids) - shared
        ids.append(sample.ids[shared:])
        where.append(torch.cat([torch.arange(shared), torch.arange(offset, offset + own)]))
        offset += own
    total = offset
    positions = torch.zeros(total, dtype=torch.long)
    mask = torch.zeros(total, total, dtype=torch.bool)
    for index in where:
        positions[index] = torch.arange(len(index))
        mask[index[:, None], index[None, :]] = torch.ones(len(index), len(index), dtype=torch.bool).tril()
    return torch.cat(ids), positions, mask, where


def collate(rows: list[list[Sample]], device: Any, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids with their attention mask (2D when every row is one sample, else the 4D
    mask of `pack_row`, with each row's layout as ``segments``, which SDPA uses to skip the masked
    blocks: `stages.common.models.packed_attention`) and position ids, and for every step, in row
    then sample order, its row, the index that predicts it (``cols``) and its token (``targets``)."""
    if all(len(row) == 1 for row in rows):
        samples = [row[0] for row in rows]
        ids = nn.utils.rnn.pad_sequence([s.ids for s in samples], batch_first=True, padding_value=pad_id)
        attention = nn.utils.rnn.pad_sequence([torch.ones_like(s.ids) for s in samples], batch_first=True)
        row_of = torch.cat([torch.full_like(s.positions, i) for i, s in enumerate(samples)])
        positions = torch.cat([s.positions for s in samples])
        return {"input_ids": ids.to(device), "attention_mask": attention.to(device), "rows": row_of.to(device),
                "cols": (positions - 1).to(device), "targets": ids[row_of, positions].to(device)}
    packed = [pack_row(row) for row in rows]
    width = max(len(ids) for ids, _, _, _ in packed)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros((len(rows), 1, width, width), dtype=torch.bool)
    row_of, cols, targets, segments = [], [], [], []
    for r, ((row_ids, row_positions, mask, where), row) in enumerate(zip(packed, rows, strict=True)):
        shared = shared_prefix(row)
        segments.append((shared, [len(sample.ids) - shared for sample in row]))
        length = len(row_ids)
        ids[r, :length], position_ids[r, :length], attention[r, 0, :length, :length] = row_ids, row_positions, mask
        attention[r, 0, length:, 0] = True  # padding rows attend to something: no all-masked softmax
        for sample, index in zip(row, where, strict=True):
            row_of.append(torch.full_like(sample.positions, r))
            cols.append(index[sample.positions - 1])
            targets.append(sample.ids[sample.positions])
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device),
            "position_ids": position_ids.to(device), "rows": torch.cat(row_of).to(device),
            "cols": torch.cat(cols).to(device), "targets": torch.cat(targets).to(device), "segments": segments}


def step_count(rows: list[list[Sample]]) -> list[int]:
    """The steps of each sample of a micro-batch, in `collate`'s order (to split its outputs)."""
    return [sample.steps for row in rows for sample in row]


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


def rank_micro_batches(parts: list[list[Sample]], token_budget: int, rank: int,
                       pack: bool = False) -> list[tuple[list[list[Sample]], float]]:
    """Rank `rank`'s micro-batches (`micro_batches`: rows of samples) of ``parts[rank]`` as (rows,
    weight 1.0), then fillers (its first micro-batch again, weight 0.0) up to the most
    micro-batches any rank has: every rank makes the same number of passes."""
    plans = [micro_batches(part, token_budget, pack) for part in parts]
    mine = plans[rank]
    return [(micro, 1.0) for micro in mine] + [(mine[0], 0.0)] * (max(len(p) for p in plans) - len(mine))


@torch.no_grad()
def score(forward: Any, micros: list[tuple[list[list[Sample]], float]], fields: tuple[str | None, ...],
          device: Any, pad_id: int, **options: Any) -> None:
    """Fill the sample attributes ``fields`` of every sample of `micros` (from
    `rank_micro_batches`: micro-batches of rows) with ``forward``'s outputs at its steps, in order
    (None skips an output): log-probs from a policy, values from the critic, both from a policy
    with its value head (``options``: ``with_values=True``). Fillers (weight 0) run and are discarded."""
    for micro, weight in micros:
        if weight:
            fill_scores(micro, fields, forward(**collate(micro, device, pad_id), **options))
        else:
            forward(**collate(micro, device, pad_id), **options)


def fill_scores(micro: list[list[Sample]], fields: tuple[str | None, ...], out: Any) -> None:
    """Set the sample attributes ``fields`` of a micro-batch's samples from a forward's outputs
    (one tensor or a tuple, in `collate`'s order; None skips an output), detached, on the CPU."""
    outputs = out if isinstance(out, tuple) else (out,)
    ordered = [sample for row in micro for sample in row]
    for field, output in zip(fields, outputs, strict=False):
        if field is None:
            continue
        for sample, part in zip(ordered, output.detach().float().cpu().split(step_count(micro)), strict=True):
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
