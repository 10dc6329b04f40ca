"""The agent proxy: plays episodes turn by turn against a generation backend (RAGEN's agent_proxy).

`play(...)` is the entry point of the agent loop that `spa generate`, `spa eval` and `spa ppo`
share. The loop is split the way RAGEN splits it:

* `EnvStateManager` (`env_manager`) owns the games: one env per episode, the episodes of a group
  on one seed; it turns a parsed response into env steps, rewards, penalties and the end of an
  episode.
* `ContextManager` (`context`) owns what the model sees: the chat messages, and the token ids of
  each episode (token-in/token-out, so PPO trains on exactly the sampled tokens).
* `AgentProxy` (here) runs the turns: it batches the live episodes' prompts to the backend, feeds
  the completions back, and repeats until every episode is done.

Choices and simplifications compared with SPA/RAGEN:

* Episodes run in waves (every episode of a wave goes to the backend in one call per turn) of
  `rollout.batch_size`, or of as many as a vLLM engine's KV cache holds (`wave_size`). RAGEN runs
  all envs at once; waves bound the memory of the HF backend's per-episode caches and let `spa
  generate` write finished episodes early, so a kill loses at most one wave.
* Sampling seeds: each backend call gets a seed (from `rollout.sample_seed`, the wave's first
  episode and the turn), which the hf backend draws its whole batch from; each request gets one of
  its own, which vLLM draws that request from alone, so that its episodes do not depend on how
  they are cut into waves. A later turn's seed comes from `rollout.sample_seed`, the episode and
  the turn; a first turn's is the puzzle's (from `rollout.sample_seed`, the game and its seed)
  plus the sample's index.
* n-requests: the samples of a puzzle start from one state, so their first prompts are equal
  token for token; consecutive samples of a wave with equal first prompts go to the backend as
  one n-request (`GenerationRequest.keys`; vLLM's ``SamplingParams(n=...)``), seeded with the
  first one's seed. vLLM draws its i-th sample with seed + i, which is that sample's own seed: an
  n-request draws what the samples' lone requests would, n independent draws, whatever the waves
  cut from the group. Later turns are one request per episode. `spa eval` (eval.n samples),
  `spa generate` and `spa ppo` (rollout.group_size) share this path.
* The stored `messages` end with the last assistant message: the final "Reward:" message of
  RAGEN's history is never shown to the model, so it is not part of the chat it saw.
* The turn-level `reward` is the env's reward only; the format penalty is kept apart (per turn in
  `penalty`, per episode in `format_penalty`) and added in `total_reward`, as SPA adds it to the
  final score. The "Reward:" message shows the env reward, as in RAGEN. So does the VAGEN arm's
  state reward (`state_reward`, per turn): it counts in `total_reward`, the score PPO trains on,
  but the prompt is the same as every other arm's.
* The prompt mode (world model or base) and render mode (coordinates or not) are the caller's:
  each stage has its own (`generate.*`, `ppo.*`, `eval.*`).
* Within a turn, action texts the game does not understand are dropped (not executed, no budget
  used) and cost the turn the format penalty; so does a malformed response or a turn with no valid
  action. One penalty per turn at most.

How far a rollout is shows on a `RolloutMeter`, which counts turns as their completions come back
from the backend (`GenerationBackend.generate`'s `progress`), tokens, and finished episodes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from stages.agent import prompts
from stages.agent.backends.base import Completion, GenerationRequest, SamplingParams
from stages.agent.context import ContextManager, visible_text
from stages.agent.env_manager import EnvStateManager
from stages.agent.episode import Episode, Turn, episode_id
from stages.agent.parsing import parse_response
from stages.agent.states import StateReward
from stages.common import distributed
from stages.common.config import EnvConfig, RolloutConfig
from stages.common.console import Progress
from stages.common.distributed import Dist
from stages.common.seeds import stable_seed

#: Generation stops after the answer; the rest of a response would be ignored anyway.
STOP_STRINGS = ("</answer>",)


class AgentProxy:
    """Plays a wave of episodes turn by turn against a generation backend."""

    def __init__(self, env: EnvConfig, rollout: RolloutConfig, backend: Any, prompt_mode: str, render_mode: str,
                 state_reward: StateReward | None = None, on_episode: Callable[[Episode], None] | None = None,
                 meter: RolloutMeter | None = None):
        self.env = env
        self.rollout = rollout
        self.backend = backend
        self.prompt_mode = prompt_mode
        self.render_mode = render_mode
        self.state_reward = state_reward
        self.tokenizer = getattr(backend, "tokenizer", None)
        self.on_episode = on_episode
        self.meter = meter

    def play_wave(self, episodes: list[Episode]) -> None:
        env_manager = EnvStateManager(self.env, self.rollout, self.render_mode)
        context = ContextManager(self.rollout, self.tokenizer, self.prompt_mode)
        env_manager.reset(episodes)
        for episode in episodes:
            game = env_manager.game(episode)
            context.start(episode, game.env, game.state, game.actions_left)
        live, turn = list(episodes), 0
        while live:
            turn += 1
            self._play_turn(live, episodes[0].id, turn, env_manager, context)
            live = self._retire(live, env_manager, context)

    def _play_turn(self, live: list[Episode], wave: str, turn: int, env_manager: EnvStateManager,
                   context: ContextManager) -> None:
        """One backend call for all live episodes, then each episode's turn."""
        prompt_ids = [context.prompt_ids(episode) for episode in live]
        requests = self._requests(live, prompt_ids, turn, env_manager)
        progress = self.meter.generated if self.meter is not None else None
        params = self._sampling_params(self._seed(wave, turn))
        completions = self.backend.generate(requests, params, progress=progress)
        if len(completions) != len(live):
            raise RuntimeError(f"backend {self.backend.name} returned {len(completions)} completions "
                               f"for {len(live)} episodes")
        for episode, ids, completion in zip(live, prompt_ids, completions):
            self._advance(episode, ids, completion, env_manager, context)

    def _requests(self, live: list[Episode], prompt_ids: list[list[int]], turn: int,
                  env_manager: EnvStateManager) -> list[GenerationRequest]:
        """A request per episode, but on the first turn one n-request for consecutive samples of a
        puzzle whose prompts are equal (see the module docstring)."""
        requests: list[GenerationRequest] = []
        last = None
        for episode, ids in zip(live, prompt_ids):
            if (turn == 1 and last is not None and ids and ids == requests[-1].prompt_ids
                    and (episode.group, episode.sample) == (last.group, last.sample + 1)):
                requests[-1].more_keys += (episode.id,)
            else:
                requests.append(GenerationRequest(episode.id, ids, env_manager.game(episode).env,
                                                  self._request_seed(episode, turn),
                                                  last_turn=turn >= self.rollout.max_turns))
            last = episode
        return requests

    def _retire(self, live: list[Episode], env_manager: EnvStateManager,
                context: ContextManager) -> list[Episode]:
        """Hand finished episodes out (and free their backend state); return the live ones."""
        finished = [episode for episode in live if episode.done]
        if finished:
            self.backend.release([episode.id for episode in finished])
        for episode in finished:
            env_manager.close(episode)
            context.finish(episode)
            if self.meter is not None:
                self.meter.finished(episode)
            if self.on_episode is not None:
                self.on_episode(episode)
        return [episode for episode in live if not episode.done]

    def _advance(self, episode: Episode, prompt_ids: list[int], completion: Completion,
                 env_manager: EnvStateManager, context: ContextManager) -> None:
        """Parse one completion, play its actions, and extend the chat."""
        game = env_manager.game(episode)
        state = game.state
        text = visible_text(completion, self.tokenizer)
        response = prompts.GENERATION_PREFIX + text
        parsed = parse_response(text, self.prompt_mode, self.rollout.max_actions_per_turn)
        result = env_manager.step(episode, parsed)
        observation_reward = prediction_reward = 0.0
        if self.state_reward is not None:
            observation_reward, prediction_reward = self.state_reward.parts(
                parsed.observation, parsed.prediction, state, result.next_state)
        episode.turns.append(Turn(
            state=state, response=response, observation=parsed.observation, prediction=parsed.prediction,
            thoughts=parsed.thoughts, actions=list(parsed.actions), executed=result.executed,
            reward=result.reward, next_state=result.next_state, format_ok=parsed.format_ok,
            done=result.done, penalty=result.penalty, state_reward_observation=observation_reward,
            state_reward_prediction=prediction_reward, finish_reason=completion.finish_reason,
            action_valid=result.action_valid, action_effective=result.action_effective,
        ))
        next_block = None
        if not result.done:
            turn = len(episode.turns) + 1
            next_block = context.next_block(episode, turn, result.next_state, game.actions_left)
        context.record(episode, response, completion, prompt_ids, result.reward, next_block)
        if result.done:
            episode.done = True
            episode.format_penalty = sum(turn.penalty for turn in episode.turns)
            episode.total_reward = (sum(turn.reward + turn.state_reward for turn in episode.turns)
                                    + episode.format_penalty)

    def _seed(self, episode_id: str, turn: int) -> int:
        """A reproducible seed named by an episode (a call's: its wave's first) and the turn: one
        fixed seed would correlate turns and waves, and PPO's fresh puzzles get fresh samples."""
        return stable_seed(self.rollout.sample_seed, f"{episode_id}-{turn}", bits=31)

    def _request_seed(self, episode: Episode, turn: int) -> int:
        """The seed of an episode's request on turn `turn`: on the first, the puzzle's seed plus
        the sample's index, the seed of the sample's place in its puzzle's n-request."""
        if turn == 1:
            return self._seed(f"{episode.env}-{episode.seed}", turn) + episode.sample
        return self._seed(episode.id, turn)

    def _sampling_params(self, seed: int) -> SamplingParams:
        rollout = self.rollout
        return SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                              top_p=rollout.top_p, stop=STOP_STRINGS, seed=seed)


def model_label(model: str, backend: str) -> str:
    """What played: the model's name, or "random" for the random-action backend."""
    return "random" if backend == "random" else model


def play(env: EnvConfig, rollout: RolloutConfig, backend: Any, seeds: Iterable[int], group_size: int, *,
         prompt_mode: str, render_mode: str, model: str = "", state_reward: StateReward | None = None,
         skip_ids: frozenset[str] | set[str] = frozenset(), first_group: int = 0,
         on_episode: Callable[[Episode], None] | None = None, meter: RolloutMeter | None = None) -> list[Episode]:
    """Play `group_size` episodes of the game `env` on each seed with `backend`, showing it the
    `prompt_mode` prompt and the `render_mode` states; return the finished episodes in seed,
    sample order.

    Episode `group` is ``first_group`` + the seed's index in `seeds` (a rank playing its share of
    a larger set passes where its share starts), `sample` its index in the group; `model` names
    the player in the records. Ids in `skip_ids` are not played (resume). `on_episode(episode)` is
    called as each episode finishes; `meter` counts the turns, tokens and episodes as they are
    played. `state_reward` (the VAGEN arm's) adds its reward to each turn. Token ids
    are kept when the backend has a tokenizer (the random backend gives text only). Of `rollout`,
    the loop reads the turn limits and sampling settings; which seeds to play is the caller's.
    """
    episodes = planned_episodes(env, backend, seeds, group_size, prompt_mode, render_mode, model, skip_ids,
                                first_group)
    if meter is not None:
        meter.plan(len(episodes), rollout.max_turns)
    proxy = AgentProxy(env, rollout, backend, prompt_mode, render_mode, state_reward, on_episode, meter)
    for wave in waves(episodes, wave_size(backend, rollout)):
        proxy.play_wave(wave)
    return episodes


def play_shared(env: EnvConfig, rollout: RolloutConfig, backend: Any, seeds: list[int], group_size: int,
                dist: Dist, *, prompt_mode: str, render_mode: str, model: str = "",
                skip_ids: frozenset[str] | set[str] = frozenset(), on_episode: Callable[[Episode], None] | None = None,
                meter: RolloutMeter | None = None) -> list[Episode]:
    """`play` split over the ranks of a launched run (`spa generate` and `spa eval`): each rank
    plays a contiguous block of the groups (`distributed.split_evenly`; a group is never split) in
    waves on its own backend. After each round of waves (one per rank, a rank whose block is done
    joins with none) the round's finished episodes are gathered: `on_episode` runs on every rank
    for every one of them, rank by rank, and every rank returns all episodes in seed, sample order.
    Each rank's `meter` counts the episodes that rank plays.

    The episodes are those one process plays with the same seeds when the backend samples each
    request apart (vllm), or when `rollout.batch_size` cuts each rank's block into the same waves
    as the whole list (it divides the episodes of every block but the last); only their order of
    finishing differs. With one process this is `play`.
    """
    modes = {"prompt_mode": prompt_mode, "render_mode": render_mode}
    if dist.world == 1:
        return play(env, rollout, backend, seeds, group_size, **modes, model=model, skip_ids=skip_ids,
                    on_episode=on_episode, meter=meter)
    block = distributed.split_evenly(len(seeds), dist.world, dist.rank)
    everything = planned_episodes(env, backend, seeds, group_size, prompt_mode, render_mode, model, skip_ids)
    own = [e for e in everything if e.group in block]
    if meter is not None:
        meter.plan(len(own), rollout.max_turns)
    mine = waves(own, wave_size(backend, rollout))
    finished: list[Episode] = []
    proxy = AgentProxy(env, rollout, backend, prompt_mode, render_mode, None, finished.append, meter)
    played: list[Episode] = []
    for index in range(distributed.all_reduce_max(len(mine), dist)):
        if index < len(mine):
            proxy.play_wave(mine[index])
        for part in distributed.all_gather(finished, dist):
            for episode in part:
                if on_episode is not None:
                    on_episode(episode)
                played.append(episode)
        finished.clear()
    return sorted(played, key=lambda e: (e.group, e.sample))


def planned_episodes(env: EnvConfig, backend: Any, seeds: Iterable[int], group_size: int, prompt_mode: str,
                     render_mode: str, model: str, skip_ids: frozenset[str] | set[str] = frozenset(),
                     first_group: int = 0) -> list[Episode]:
    """The episodes `play` plays, not started yet, in seed, sample order."""
    label = model_label(model, getattr(backend, "name", ""))
    return [
        Episode(episode_id(env.name, seed, sample), env.name, seed, first_group + group, sample, prompt_mode,
                render_mode, label)
        for group, seed in enumerate(seeds) for sample in range(group_size)
        if episode_id(env.name, seed, sample) not in skip_ids
    ]


def wave_size(backend: Any, rollout: RolloutConfig) -> int:
    """The episodes played together: as many as a vLLM engine holds at once (its `concurrency`),
    else `rollout.batch_size`."""
    return getattr(backend, "concurrency", None) or rollout.batch_size


def waves(episodes: list[Episode], batch_size: int) -> list[list[Episode]]:
    """The episodes in waves of `batch_size`, each played together (see the module docstring)."""
    return [episodes[start:start + batch_size] for start in range(0, len(episodes), batch_size)]


class RolloutMeter:
    """How far a rollout is, for a progress display (`stages.common.console.Progress`).

    It counts turns: each episode has up to `rollout.max_turns`, and one that ends early gives up
    the turns it did not play, so `done` reaches `total` as the last episode ends. A turn counts
    when its completion is back; the hf backend reports each completion of a batch as it finishes,
    with the tokens sampled so far, so the count moves within a backend call (one turn of a whole
    wave, long on a CPU), not only between calls. `figures()` adds the episodes finished and
    solved and the tokens generated.

    Given a `bar`, the meter shows itself on it: as the bar's count, with the ETA of `rollout_eta`
    (the turns only bound the work: most episodes end early) (generate, eval), or, with `within`
    ("step 3" of ppo), in the figures of a bar that counts something else.
    """

    def __init__(self, bar: Progress | None = None, within: str = ""):
        self.bar, self.within = bar, within
        self.total = self.done = self.tokens = self.episodes = self.solved = 0
        self.max_turns = 0
        self.started = time.perf_counter()
        if bar is not None and not within:
            bar.estimate = self.eta_seconds

    def plan(self, episodes: int, max_turns: int) -> None:
        """Expect `episodes` more episodes of up to `max_turns` turns each."""
        self.max_turns = max_turns
        self.total += episodes * max_turns
        self._show()

    def generated(self, tokens: int, completions: int) -> None:
        """A backend's report: `tokens` more sampled, `completions` more finished (a turn each)."""
        self.tokens += tokens
        self.done += completions
        self._show()

    def finished(self, episode: Episode) -> None:
        self.episodes += 1
        self.solved += bool(episode.success)
        self.done += self.max_turns - len(episode.turns)
        self._show()

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def planned(self) -> int:
        return self.total // self.max_turns if self.max_turns else 0

    def eta_seconds(self) -> float | None:
        return rollout_eta(self.seconds(), self.episodes, self.planned())

    def figures(self) -> str:
        # no tokens: the random backend
        tokens = f", {self.tokens} tok ({self.tokens / max(self.seconds(), 1e-9):.0f}/s)" if self.tokens else ""
        return f"episodes {self.episodes}/{self.planned()} ({self.solved} solved){tokens}"

    def _show(self) -> None:
        if self.bar is None:
            return
        if self.within:
            self.bar.update(self.bar.done, f"{self.within}: rollout {self.done}/{self.total} turns, {self.figures()}")
        else:
            self.bar.update(self.done, self.figures(), total=self.total)


def rollout_eta(seconds: float, finished: int, planned: int) -> float | None:
    """Seconds left of a rollout of `planned` episodes, `seconds` in with `finished` done: the
    episodes left at the rate they have finished so far; None until one has.

    Not from the turns or tokens: the bound on them (every episode playing every turn, every turn
    its max_new_tokens) is several times what games take, and their rate changes within a wave as
    its episodes end (a wave runs as long as its longest episode). The first episodes to finish
    are the short ones of the first wave, so the first estimates are rough (high while a wave's
    long episodes play); it is exact for equal waves at their ends."""
    if finished == 0:
        return None
    return seconds * (planned - finished) / finished
