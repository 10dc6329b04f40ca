"""The environment manager of the agent loop: the games behind the episodes, and what a turn's
actions do to them (RAGEN's es_manager)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import envs
from envs import EnvError, TextGameEnv
from stages.agent.episode import Episode
from stages.agent.parsing import ParsedResponse
from stages.common.config import EnvConfig, RolloutConfig
from stages.common.errors import UserError


def make_env(config: EnvConfig, render_mode: str) -> TextGameEnv:
    """The game `config` names, with its options, rendering in `render_mode`; a bad name or option
    is one UserError line."""
    try:
        return envs.make(config.name, **{"render_mode": render_mode, **config.options})
    except EnvError as err:
        raise UserError(str(err)) from None


def check_modes(config: EnvConfig, prompt_mode: str, render_mode: str, section: str) -> TextGameEnv:
    """The game, built after checking that it has the prompt and render mode that the config
    section `section` ("generate", "ppo", "eval") asks for; otherwise one UserError line that names
    the setting to change."""
    try:
        cls = envs.spec(config.name).load_class()
    except EnvError as err:
        raise UserError(str(err)) from None
    for kind, wanted, offered in (("prompt", prompt_mode, envs.prompt_modes(cls)),
                                  ("render", render_mode, envs.render_modes(cls))):
        if wanted not in offered:
            choices = " or ".join(f"{section}.{kind}_mode={mode}" for mode in offered)
            raise UserError(f"{config.name} has no {wanted!r} {kind} mode ({section}.{kind}_mode); its {kind} "
                            f"modes: {', '.join(offered)}; set {choices}")
    return make_env(config, render_mode)


@dataclass
class _Game:
    """The env behind one episode and its budget."""

    env: TextGameEnv
    state: str
    actions_left: int
    turns_played: int = 0


@dataclass
class TurnResult:
    executed: list[str]
    reward: float
    next_state: str
    penalty: float
    done: bool
    action_valid: list[bool]
    action_effective: list[bool]


class EnvStateManager:
    """Runs the games: resets the envs of each group on one seed and executes the agent's actions."""

    def __init__(self, env: EnvConfig, rollout: RolloutConfig, render_mode: str):
        self.env_config = env
        self.rollout = rollout
        self.render_mode = render_mode
        self.games: dict[str, _Game] = {}

    def budget(self, env: TextGameEnv) -> int:
        return self.rollout.max_actions_per_traj or env.max_actions_per_traj

    def reset(self, episodes: list[Episode]) -> None:
        """Start every episode; episodes of one seed get copies of one reset env (same puzzle).

        Copying instead of resetting each env saves the puzzle generation, which is slow for large
        Sokoban rooms; a copy carries the same random state, as a reset on the same seed would.
        """
        first_of_seed: dict[int, TextGameEnv] = {}
        for episode in episodes:
            if episode.seed not in first_of_seed:
                env = make_env(self.env_config, self.render_mode)
                env.reset(seed=episode.seed)
                first_of_seed[episode.seed] = env
                game_env = env
            else:
                game_env = copy.deepcopy(first_of_seed[episode.seed])
            self.games[episode.id] = _Game(game_env, game_env.render(), self.budget(game_env))

    def game(self, episode: Episode) -> _Game:
        return self.games[episode.id]

    def step(self, episode: Episode, parsed: ParsedResponse) -> TurnResult:
        """Execute one turn's actions and decide whether the episode is over."""
        game = self.games[episode.id]
        canonical = [game.env.parse_action(text) for text in parsed.actions]
        valid = [action for action in canonical if action is not None]
        bad_turn = not parsed.format_ok or not valid or len(valid) < len(parsed.actions)
        penalty = self.rollout.format_penalty if bad_turn else 0.0

        executed, effective, reward = [], [], 0.0
        understood = {action: True for action in valid}
        terminated = truncated = success = False
        for action in valid[:game.actions_left]:
            game.state, step_reward, terminated, truncated, info = game.env.step(action)
            reward += step_reward  # a running float sum, so the prompt shows SPA's float artifacts
            executed.append(action)
            effective.append(bool(info.get("action_is_effective")))
            # Sudoku parses any "r,c,v"; the env then says whether the move was allowed at all.
            understood[action] = understood[action] and bool(info.get("action_is_valid", True))
            game.actions_left -= 1
            if terminated or truncated:
                success = terminated and not truncated and bool(info.get("success"))
                break
        game.turns_played += 1
        out_of_budget = game.actions_left <= 0 and not (terminated or truncated)
        done = terminated or truncated or out_of_budget or game.turns_played >= self.rollout.max_turns
        episode.success = success
        episode.truncated = truncated or out_of_budget
        action_valid = [action is not None and understood[action] for action in canonical]
        return TurnResult(executed, reward, game.state, penalty, done, action_valid, effective)

    def close(self, episode: Episode) -> None:
        self.games.pop(episode.id, None)


