"""The paper's random-action baseline: no model, random actions wrapped in the response format.

Each completion is what follows the generation prefix ``<think>``: fixed reasoning text and
``rollout.random_actions`` = [min, max] actions (a uniform count; SPA's wrapper plays 3) drawn by
the game's own ``sample_action``. With ``rollout.random_reasoning: actions`` the reasoning also names
the actions drawn ("... I move Left, Up."), so that the prediction written after it is the next
state of a stated action, as in self-play data where the model's reasoning states its plan; the
paper's RandSFT keeps the sentence fixed (the default). With ``rollout.random_moves: effective``
each action is drawn among those that change the state, tried on a copy of the game: uniform
random Sokoban moves walk into a wall about half the time, and a model trained on them learns
that the next state is usually the current one (on slippery FrozenLake the copy slips as the game
will, so the data keeps fewer slips that end where they began than the ice makes). In world-model
mode the ``<observation>`` and ``<prediction>`` tags are left empty; ``spa clean`` fills them with
the true states, which turns these episodes into the paper's RandSFT data.

Each episode draws from its own generator, seeded from (seed, key, turn) with a stable hash, so
an episode's actions do not depend on which other episodes share its batch or on their order.
"""

from __future__ import annotations

import copy
import random

from stages.agent.backends.base import Completion, GenerationRequest, OnProgress, SamplingParams, all_singles
from stages.common.errors import UserError
from stages.common.seeds import stable_seed

# The fixed reasoning sentence per game ("I will push the box to the target." is the paper's).
REASONS = {
    "sokoban": "I will push the box to the target.",
    "frozen_lake": "I will walk around the holes to the goal.",
    "sudoku": "I will fill an empty cell with a number that fits.",
}
DEFAULT_REASON = "I will move toward the goal."
PROMPT_MODES = ("world_model", "base")


class RandomBackend:
    name = "random"
    tokenizer = None  # text only
    model = None  # no Hugging Face model in this process

    def __init__(self, prompt_mode: str, seed: int = 0, actions_per_turn: tuple[int, int] = (3, 3),
                 name_actions: bool = False, effective_only: bool = False):
        if prompt_mode not in PROMPT_MODES:
            raise UserError(f"prompt_mode must be one of {', '.join(PROMPT_MODES)}, got {prompt_mode!r}")
        low, high = actions_per_turn
        if not 1 <= low <= high:
            raise UserError(f"rollout.random_actions must be [min, max] with 1 <= min <= max, got {[low, high]}")
        self.prompt_mode = prompt_mode
        self.seed = seed
        self.actions_per_turn = (low, high)
        self.name_actions = name_actions
        self.effective_only = effective_only
        self._turns: dict[str, int] = {}  # calls seen per key, so each turn draws fresh actions

    def generate(self, requests: list[GenerationRequest], params: SamplingParams,
                 progress: OnProgress | None = None) -> list[Completion]:
        completions = [self._complete(single) for single in all_singles(requests)]
        if progress is not None:
            progress(0, len(completions))  # text, no tokens
        return completions

    def release(self, keys: list[str]) -> None:
        for key in keys:
            self._turns.pop(key, None)

    def close(self) -> None:
        self._turns.clear()

    def _complete(self, request: GenerationRequest) -> Completion:
        env = request.env
        if env is None:
            raise ValueError(f"the random backend needs the env of request {request.key!r}")
        turn = self._turns.get(request.key, 0)
        self._turns[request.key] = turn + 1
        rng = random.Random(stable_seed(self.seed, request.key, turn))
        low, high = self.actions_per_turn
        count = low if low == high else rng.randint(low, high)  # one draw fewer keeps fixed counts' actions as before
        drawn = _effective_actions(env, rng, count) if self.effective_only else \
            [env.sample_action(rng) for _ in range(count)]
        actions = " || ".join(drawn)
        reason = reasoning(env.name, drawn if self.name_actions else None)
        if self.prompt_mode == "world_model":
            think = f" <observation></observation> {reason} <prediction></prediction>"
        else:
            think = f" {reason}"
        return Completion(token_ids=[], text=f"{think} </think> <answer> {actions} </answer>", logprobs=None,
                          finish_reason="stop")


def reasoning(game: str, actions: list[str] | None = None) -> str:
    """The game's fixed reasoning sentence; with `actions`, followed by one naming them
    (``rollout.random_reasoning: actions``)."""
    reason = REASONS.get(game, DEFAULT_REASON)
    return f"{reason} I move {', '.join(actions)}." if actions else reason


#: Draws of `sample_action` tried for one effective action before taking one that changes nothing.
EFFECTIVE_TRIES = 32


def _effective_actions(env, rng: random.Random, count: int) -> list[str]:
    """`count` actions, each uniform over those that change the state after the ones before it
    (rejection sampling on a copy of `env`); drawing stops when the game ends. An action that
    changes nothing is kept only when `EFFECTIVE_TRIES` draws found none that does."""
    game = copy.deepcopy(env)
    drawn: list[str] = []
    while len(drawn) < count:
        for _ in range(EFFECTIVE_TRIES):
            action = game.sample_action(rng)
            trial = copy.deepcopy(game)
            *_, info = trial.step(action)
            if info.get("action_is_effective"):
                break
        drawn.append(action)
        _, _, terminated, truncated, _ = game.step(action)
        if terminated or truncated:
            break
    return drawn
