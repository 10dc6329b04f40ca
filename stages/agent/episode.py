"""The records of the agent loop: an `Episode` and its `Turn`s, as `spa generate` writes them.

`Episode.to_json()` is one line of trajectories.jsonl; the token fields (token-in/token-out) stay
in memory for `spa ppo`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Turn:
    """One assistant turn and what it did to the game."""

    state: str  # the state text shown in this turn's user message
    response: str  # the raw completion with the "<think>" prefix put back
    observation: str | None
    prediction: str | None
    thoughts: str | None
    actions: list[str]  # parsed action texts (at most max_actions_per_turn)
    executed: list[str]  # canonical actions that ran, in order
    reward: float  # sum of the env's step rewards (Python float sum, as SPA shows it)
    next_state: str  # the state after the executed actions (== state when none ran)
    format_ok: bool
    done: bool  # the episode ended with this turn
    penalty: float = 0.0  # the format penalty charged to this turn (0.0 or rollout.format_penalty)
    # The VAGEN arm's reward for correct states (`stages.agent.states`; 0 otherwise): its
    # <observation> part and its <prediction> part, weighted; `state_reward` is their sum.
    state_reward_observation: float = 0.0
    state_reward_prediction: float = 0.0
    finish_reason: str = "stop"  # the backend's: stop, eos, or length
    # Per parsed action: the game understood it (parse, and the env's action_is_valid when it ran).
    action_valid: list[bool] = field(default_factory=list)
    # Per executed action: it changed the state (the env's action_is_effective).
    action_effective: list[bool] = field(default_factory=list)

    @property
    def state_reward(self) -> float:
        return self.state_reward_observation + self.state_reward_prediction


@dataclass
class Segment:
    """One turn's prompt and completion tokens, when the episode is not a single sequence."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None


@dataclass
class Episode:
    """One played episode. `to_json()` is the trajectory line of `spa generate` (docs/formats.md).

    Token fields (filled when a tokenizer is given): with the full history in the prompt
    (`single_sequence`), `token_ids` is the whole conversation as the model consumed and produced
    it, `response_mask` is 1 exactly on sampled tokens, `logprobs` holds the sampler's log-prob on
    sampled tokens and 0.0 elsewhere (None if the backend gave none) and `turn_spans[k]` is the
    (start, end) slice of turn k's completion. With `rollout.history_window` each turn's prompt is
    rebuilt, so the turns live in `segments` instead and `single_sequence` is False; `messages`
    always holds the whole chat.
    """

    id: str
    env: str
    seed: int
    group: int
    sample: int
    prompt_mode: str
    render_mode: str
    model: str
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    success: bool = False
    total_reward: float = 0.0
    format_penalty: float = 0.0
    done: bool = False
    truncated: bool = False
    # token bookkeeping
    single_sequence: bool = True
    token_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        turn_keys = ("state", "response", "observation", "prediction", "thoughts", "actions", "executed",
                     "reward", "next_state", "format_ok", "done", "penalty", "state_reward",
                     "state_reward_observation", "state_reward_prediction", "action_valid", "action_effective")
        return {
            "id": self.id, "env": self.env, "seed": self.seed, "group": self.group, "sample": self.sample,
            "prompt_mode": self.prompt_mode, "render_mode": self.render_mode, "model": self.model,
            "turns": [{key: getattr(turn, key) for key in turn_keys} for turn in self.turns],
            "messages": self.messages, "success": self.success, "total_reward": self.total_reward,
            "format_penalty": self.format_penalty,
        }


def episode_id(env_name: str, seed: int, sample: int) -> str:
    return f"{env_name}-{seed}-{sample}"


