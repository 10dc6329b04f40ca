"""From played episodes to PPO samples, and the passes over them.

An episode (`stages.agent.episode.Episode`, token-in/token-out) becomes a `Sample`: its token
ids, the positions that are PPO steps (the loss mask), its rewards on those steps; later phases
fill in old log-probs, values, advantages and returns. Samples are grouped into micro-batches of
bounded padded size (`micro_batches`) and collated into right-padded tensors (`collate`); every
loss is a weighted sum over steps with the normaliser of the whole mini-batch (`loss_agg`), so the
grouping never changes it.

Prefix sharing (`ppo.share_prefix`): the episodes of a group play one puzzle, so they share their
first prompt (system prompt, instruction, first state: most of a one-turn episode's tokens), and
every episode of a mini-batch shares the system prompt and instruction. A micro-batch's samples
then go into one sequence laid out as a prefix tree (`stages.common.prefix_tree`): what all share
once, what a group shares once, then each episode's own tokens, with position ids and attention
that give every token exactly its own episode's context. The actor's, critic's and reference's
passes compute each shared token once, and their outputs and gradients are those of the
unshared samples.

Over several ranks (`rank_shares`, `rank_micro_batches`) each mini-batch is split into equal
parts, one per rank, balanced by tokens (sharing joins the samples within a part); every rank
makes the same number of passes (fillers of weight 0 where its part needs fewer), since ZeRO's
collectives run in every backward (and, under ZeRO-3, in every forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stages.agent import prompts
from stages.common import prefix_tree
from stages.common.config import PPOConfig
from stages.common.prefix_tree import common_prefix_len
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


def micro_batches(samples: list[Sample], token_budget: int, share: bool = False) -> list[list[list[Sample]]]:
    """The passes over `samples`: micro-batches of rows, each row a list of samples.

    Without `share` every row is one sample, rows are grouped by length (shortest first) so that
    little compute goes to padding, and a micro-batch's padded size (rows x longest) stays within
    ``token_budget``. With `share` a micro-batch is one row, its samples packed as a prefix tree
    (`stages.common.prefix_tree`): the instruction every episode shares and each group's first
    prompt are computed once. The samples are taken in token order (a group's episodes, which
    share their first prompt, side by side) and a micro-batch ends where the next sample would take
    its packed length, or the positions the LM head scores (every sample's steps, shared tokens
    included: ``ppo.loss_mask: all`` scores the shared prompt once per episode), past
    ``token_budget`` (one sample longer than it goes alone). Unshared, the padded size bounds both.
    Every loss is a weighted sum over steps with the mini-batch's normaliser
    (`stages.training.loss_agg`), so neither the packing nor the grouping changes it.
    """
    if share:
        return [[row] for row in _shared_rows(samples, token_budget)]
    batches: list[list[list[Sample]]] = []
    current: list[list[Sample]] = []
    for sample in sorted(samples, key=lambda s: len(s.ids)):  # sorted() is stable: deterministic
        if current and len(sample.ids) * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append([sample])
    if current:
        batches.append(current)
    return batches


def _shared_rows(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    tokens = [s.ids.tolist() for s in samples]
    rows: list[list[Sample]] = []
    row: list[Sample] = []
    packed, scored, previous = 0, 0, []
    for i in sorted(range(len(samples)), key=lambda i: (tokens[i], i)):
        added = len(tokens[i]) - prefix_tree.common_prefix_len(previous, tokens[i])  # sorted: the tree's growth
        if row and max(packed + added, scored + samples[i].steps) > token_budget:
            rows.append(row)
            row, added = [], len(tokens[i])
            packed, scored = 0, 0
        row.append(samples[i])
        packed, scored, previous = packed + added, scored + samples[i].steps, tokens[i]
    if row:
        rows.append(row)
    return rows


def collate(rows: list[list[Sample]], device: Any, pad_id: int) -> dict[str, torch.Tensor]:
    """The model inputs of a micro-batch, and for every step, in row then sample order, its row,
    the index that predicts it (``cols``) and its token (``targets``).

    Rows of one sample: right-padded ids with a 2D attention mask. A micro-batch of one row of
    several samples (`micro_batches` with ``share``): the samples packed as a prefix tree, with its
    position ids and its attention structure as ``layout`` (a `TreeLayout`, which the model's
    attention reads: `stages.common.kernels.attention.spa_sdpa`)."""
    if all(len(row) == 1 for row in rows):
        samples = [row[0] for row in rows]
        ids = nn.utils.rnn.pad_sequence([s.ids for s in samples], batch_first=True, padding_value=pad_id)
        attention = nn.utils.rnn.pad_sequence([torch.ones_like(s.ids) for s in samples], batch_first=True)
        row_of = torch.cat([torch.full_like(s.positions, i) for i, s in enumerate(samples)])
        positions = torch.cat([s.positions for s in samples])
        return {"input_ids": ids.to(device), "attention_mask": attention.to(device), "rows": row_of.to(device),
                "cols": (positions - 1).to(device), "targets": ids[row_of, positions].to(device)}
    (row,) = rows
    packed = prefix_tree.pack([s.ids.tolist() for s in row])
    where = [torch.tensor(w) for w in packed.where]
    cols = torch.cat([index[s.positions - 1] for s, index in zip(row, where, strict=True)])
    return {"input_ids": torch.tensor([packed.ids], device=device),
            "attention_mask": prefix_tree.placeholder_mask(len(packed), device),
            "position_ids": torch.tensor([packed.positions], device=device),
            "rows": torch.zeros_like(cols).to(device), "cols": cols.to(device),
            "targets": torch.cat([s.ids[s.positions] for s in row]).to(device),
            "layout": prefix_tree.TreeLayout(packed.nodes, device)}


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
                       share: bool = False) -> list[tuple[list[list[Sample]], float]]:
    """Rank `rank`'s micro-batches (`micro_batches`: rows of samples) of ``parts[rank]`` as (rows,
    weight 1.0), then fillers (its first micro-batch again, weight 0.0) up to the most
    micro-batches any rank has: every rank makes the same number of passes. A rank without samples
    (a last mini-batch of fewer episodes than ranks, ``ppo.filter_include_zero: false``) fills with
    another rank's first micro-batch."""
    plans = [micro_batches(part, token_budget, share) for part in parts]
    mine = plans[rank]
    filler = mine[0] if mine else next(plan[0] for plan in plans if plan)
    return [(micro, 1.0) for micro in mine] + [(filler, 0.0)] * (max(len(p) for p in plans) - len(mine))


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
        advantages = algos.group_advantages(scores, groups, norm_by_std=ppo.norm_adv_by_std_in_grpo)
        unpad(samples, "advantages", advantages[:, None] * mask)
        return
    advantages, returns = _gae(samples, ppo)
    unpad(samples, "advantages", algos.masked_whiten(advantages, mask))
    unpad(samples, "returns", returns)


def compute_returns(samples: list[Sample], ppo: PPOConfig) -> None:
    """The critic's targets of `samples` alone, equal to `compute_advantages`'s over any batch that
    holds them (an episode's GAE reads only its own steps; only the advantages' whitening is
    batch-wide)."""
    unpad(samples, "returns", _gae(samples, ppo)[1])


def _gae(samples: list[Sample], ppo: PPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    values, mask = padded(samples, "values"), step_mask(samples)
    if ppo.advantage == "gae":
        return algos.masked_gae(padded(samples, "rewards"), values, mask, ppo.gamma, ppo.lam)
    return algos.bilevel_gae(padded(samples, "turn_rewards"), values, mask, padded(samples, "turn_ends"),
                             ppo.gamma, ppo.lam, ppo.turn_gamma)
