"""The agent loop, driven by scripted policies: exact trajectories, prompts and token bookkeeping."""

from __future__ import annotations

import itertools
import random
from typing import ClassVar

import pytest

import envs
from envs.base import TextGameEnv
from envs.registry import EnvSpec
from stages.agent import prompts
from stages.agent.backends.base import Completion, all_singles
from stages.agent.episode import Episode
from stages.agent.proxy import RolloutMeter, play
from stages.agent.states import StateReward
from stages.common.config import SPAConfig, load_config
from stages.common.errors import UserError
from stages.common.seeds import stable_seed

# ---- a tiny game ---------------------------------------------------------------------------------


class CorridorEnv(TextGameEnv):
    """A 1x5 corridor: the player starts at column seed % 2 and walks Right to the goal in column 4.

    -0.1 per step, +1 more on reaching the goal, which ends the episode. Walking into the end wall
    keeps the player in place. Budget: 4 actions per episode.
    """

    name: ClassVar[str] = "corridor"
    action_names: ClassVar[tuple[str, ...]] = ("Left", "Right")
    legend: ClassVar[dict[str, str]] = {"P": "player", "_": "empty", "G": "goal"}
    instructions: ClassVar[dict[str, str]] = {"world_model": "Walk right to G.", "base": "Reach G."}
    max_actions_per_traj: ClassVar[int] = 4
    GOAL = 4

    def __init__(self, render_mode: str = "coords"):
        super().__init__(render_mode=render_mode)
        self.pos = 0

    def _reset(self, rng: random.Random) -> None:
        self.pos = self._seed % 2

    def _step(self, action: str) -> tuple[float, bool, bool, dict]:
        name = self.parse_action(action)
        if name is None or self.pos == self.GOAL:
            return 0.0, self.pos == self.GOAL, False, {"success": self.pos == self.GOAL,
                                                       "action_is_valid": name is not None,
                                                       "action_is_effective": False}
        before = self.pos
        self.pos = min(max(self.pos + (1 if name == "Right" else -1), 0), self.GOAL)
        reward = -0.1 + (1.0 if self.pos == self.GOAL else 0.0)
        return reward, self.pos == self.GOAL, False, {"success": self.pos == self.GOAL, "action_is_valid": True,
                                                      "action_is_effective": self.pos != before}

    def render_grid(self) -> str:
        return "".join("P" if i == self.pos else "G" if i == self.GOAL else "_" for i in range(5))

    def coordinate_line(self) -> str:
        return f"Player (P) is at (0,{self.pos}); goal (G) is at (0,{self.GOAL})."


@pytest.fixture
def corridor(monkeypatch):
    monkeypatch.setitem(envs.registry.SPECS, "corridor",
                        EnvSpec("corridor", "spa/Corridor-v0", f"{__name__}:CorridorEnv"))


def play_with(config: SPAConfig, backend, seeds, group_size, **kwargs) -> list[Episode]:
    modes = {"prompt_mode": "world_model", "render_mode": "coords", **kwargs}
    return play(config.env, config.rollout, backend, seeds, group_size, model=config.model.name, **modes)


def make_config(**rollout) -> SPAConfig:
    config = SPAConfig()
    config.env.name = "corridor"
    config.rollout.max_turns = 3
    config.rollout.max_actions_per_turn = 2
    for key, value in rollout.items():
        setattr(config.rollout, key, value)
    return config


# ---- a scripted policy ---------------------------------------------------------------------------


def wm(answer: str, thoughts: str = "go") -> str:
    """A well-formed world-model completion (the text after the "<think>" prefix)."""
    return (f" <observation>o</observation> {thoughts} <prediction>p</prediction> </think> "
            f"<answer>{answer}</answer>")


class ScriptedBackend:
    """Returns fixed texts per (episode id, turn); records every prompt, request seed and release."""

    name = "scripted"

    def __init__(self, script: dict[str, list[str]], tokenizer=None, eos_turns: frozenset = frozenset()):
        self.script, self.tokenizer, self.eos_turns = script, tokenizer, eos_turns
        self.prompts: dict[tuple[str, int], list[int]] = {}
        self.completions: dict[tuple[str, int], list[int]] = {}
        self.seeds: dict[tuple[str, int], int] = {}
        self.last_turns: dict[tuple[str, int], bool] = {}
        self.released: list[str] = []
        self.batches: list[int] = []  # requests per call
        self.keys: list[list[tuple[str, ...]]] = []  # per call, the keys of each request
        self.params = []

    def generate(self, requests, params, progress=None):
        self.batches.append(len(requests))
        self.params.append(params)
        self.keys.append([request.keys for request in requests])
        out = []
        for request in all_singles(requests):
            turn = sum(1 for key, _ in self.prompts if key == request.key) + 1
            self.prompts[(request.key, turn)] = list(request.prompt_ids)
            self.seeds[(request.key, turn)] = request.seed
            self.last_turns[(request.key, turn)] = request.last_turn
            text = self.script[request.key][turn - 1]
            if self.tokenizer is None:
                out.append(Completion(token_ids=[], text=text))
                continue
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            finish = "stop"
            if (request.key, turn) in self.eos_turns:  # stopped on the end-of-turn token, decoded with it
                ids, text = ids + [self.tokenizer.eos_token_id], text + self.tokenizer.eos_token
                finish = "eos"
            self.completions[(request.key, turn)] = ids
            out.append(Completion(token_ids=ids, text=text, logprobs=[-0.5] * len(ids), finish_reason=finish))
        return out

    def release(self, keys):
        self.released.extend(keys)


SCRIPT = {
    # three turns, ends on the goal with the last action of the budget
    "corridor-10-0": [wm("Right || right || Right"), wm("Jump || Right"), wm("Right || Right")],
    # malformed first turn, bumps into the wall, stopped by max_turns
    "corridor-10-1": [" I will go right. <answer>Right</answer>", wm("Left || Left"), wm("Right")],
    # runs out of the 4-action budget in turn 2
    "corridor-11-0": [wm("Right || Right"), wm("Left || Left")],
    # reaches the goal with the first action of turn 2; the second is never executed
    "corridor-11-1": [wm("Right || Right"), wm("Right || Left")],
}

FORMAT = ("<think> <observation> [current state] </observation> [Your thoughts] <prediction> [next state]"
          "</prediction> </think> <answer> [your answer] </answer>")
USER_1 = (
    "Walk right to G.\nThe meaning of each symbol in the state is:\nP: player, _: empty, G: goal"
    "\nYour available actions are:\nLeft, Right\nYou can make up to 4 actions, separated by the action "
    'separator " || "\n'
    "\nTurn 1:\nState:\nP___G\nPlayer (P) is at (0,0); goal (G) is at (0,4).\nYou have 4 actions left. "
    f"Always output: {FORMAT} with no extra text. Strictly follow this format. "
    "Max response length: 100 words (tokens).\n"
)
USER_2 = (
    "Reward:\n-0.2\n"
    "\nTurn 2:\nState:\n__P_G\nPlayer (P) is at (0,2); goal (G) is at (0,4).\nYou have 2 actions left. "
    f"Always output: {FORMAT} with no extra text. Strictly follow this format. "
    "Max response length: 100 words (tokens).\n"
)


def state(pos: int) -> str:
    grid = "".join("P" if i == pos else "G" if i == 4 else "_" for i in range(5))
    return f"{grid}\nPlayer (P) is at (0,{pos}); goal (G) is at (0,4)."


GOAL_STATE = "____P\nPlayer (P) is at (0,4); goal (G) is at (0,4)."


def turn(pos, response, actions, executed, reward, next_pos, format_ok=True, done=False, penalty=0.0,
         valid=None, effective=None):
    parsed_ok = format_ok
    return {
        "state": state(pos), "response": "<think>" + response,
        "observation": "o" if parsed_ok else None, "prediction": "p" if parsed_ok else None,
        "thoughts": "go" if parsed_ok else None, "actions": actions, "executed": executed,
        "reward": reward, "next_state": GOAL_STATE if next_pos == 4 else state(next_pos),
        "format_ok": format_ok, "done": done, "penalty": penalty, "state_reward": 0.0,
        "state_reward_observation": 0.0, "state_reward_prediction": 0.0,
        "action_valid": [True] * len(actions) if valid is None else valid,
        "action_effective": [True] * len(executed) if effective is None else effective,
    }


EXPECTED_TURNS = {
    "corridor-10-0": [
        turn(0, SCRIPT["corridor-10-0"][0], ["Right", "right"], ["Right", "Right"], -0.2, 2),
        turn(2, SCRIPT["corridor-10-0"][1], ["Jump", "Right"], ["Right"], -0.1, 3, penalty=-0.1,
             valid=[False, True]),
        turn(3, SCRIPT["corridor-10-0"][2], ["Right", "Right"], ["Right"], 0.9, 4, done=True),
    ],
    "corridor-10-1": [
        turn(0, SCRIPT["corridor-10-1"][0], [], [], 0.0, 0, format_ok=False, penalty=-0.1),
        turn(0, SCRIPT["corridor-10-1"][1], ["Left", "Left"], ["Left", "Left"], -0.2, 0,
             effective=[False, False]),
        turn(0, SCRIPT["corridor-10-1"][2], ["Right"], ["Right"], -0.1, 1, done=True),
    ],
    "corridor-11-0": [
        turn(1, SCRIPT["corridor-11-0"][0], ["Right", "Right"], ["Right", "Right"], -0.2, 3),
        turn(3, SCRIPT["corridor-11-0"][1], ["Left", "Left"], ["Left", "Left"], -0.2, 1, done=True),
    ],
    "corridor-11-1": [
        turn(1, SCRIPT["corridor-11-1"][0], ["Right", "Right"], ["Right", "Right"], -0.2, 3),
        turn(3, SCRIPT["corridor-11-1"][1], ["Right", "Left"], ["Right"], 0.9, 4, done=True),
    ],
}
EXPECTED_OUTCOME = {  # success, total_reward, format_penalty
    "corridor-10-0": (True, 0.5, -0.1),
    "corridor-10-1": (False, -0.4, -0.1),
    "corridor-11-0": (False, -0.4, 0.0),
    "corridor-11-1": (True, 0.7, 0.0),
}


def run_script(tokenizer=None, eos_turns=frozenset(), **rollout) -> tuple[list[Episode], ScriptedBackend]:
    backend = ScriptedBackend(SCRIPT, tokenizer, eos_turns)
    episodes = play_with(make_config(**rollout), backend, [10, 11], 2)
    return episodes, backend


# ---- the trajectories ----------------------------------------------------------------------------


def test_exact_trajectories(corridor):
    finished = []
    backend = ScriptedBackend(SCRIPT)
    episodes = play_with(make_config(), backend, [10, 11], 2, on_episode=finished.append)
    assert [e.id for e in episodes] == list(SCRIPT)
    for episode in episodes:
        row = episode.to_json()
        assert row["turns"] == EXPECTED_TURNS[episode.id], episode.id
        success, total, penalty = EXPECTED_OUTCOME[episode.id]
        assert (row["success"], row["format_penalty"]) == (success, penalty), episode.id
        assert row["total_reward"] == pytest.approx(total, abs=1e-12), episode.id
        assert row["total_reward"] == sum(t["reward"] for t in row["turns"]) + row["format_penalty"]
        assert (row["env"], row["prompt_mode"], row["model"]) == ("corridor", "world_model", "smollm2-135m")
    groups = {e.id: (e.seed, e.group, e.sample) for e in episodes}
    assert groups == {"corridor-10-0": (10, 0, 0), "corridor-10-1": (10, 0, 1),
                      "corridor-11-0": (11, 1, 0), "corridor-11-1": (11, 1, 1)}
    assert sorted(e.id for e in finished) == sorted(SCRIPT)
    assert sorted(backend.released) == sorted(SCRIPT)  # each released once, when done
    assert backend.batches == [4, 4, 2]  # live episodes are batched together every turn
    assert episodes[2].truncated and not episodes[0].truncated


def test_messages_and_prompt_text(corridor):
    episodes, _ = run_script()
    messages = episodes[0].messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user",
                                             "assistant"]
    assert messages[0]["content"] == "You're a helpful assistant. "
    assert messages[1]["content"] == USER_1
    assert messages[2]["content"] == "<think>" + SCRIPT["corridor-10-0"][0]
    assert messages[3]["content"] == USER_2
    assert messages[5]["content"].startswith("Reward:\n-0.1\n\nTurn 3:\nState:\n___PG\n")
    assert "You have 1 actions left." in messages[5]["content"]
    # the malformed episode's second prompt shows the unchanged state and the full budget
    assert episodes[1].messages[3]["content"].startswith("Reward:\n0.0\n\nTurn 2:\nState:\nP___G\n")
    assert "You have 4 actions left." in episodes[1].messages[3]["content"]


def test_base_prompt_mode(corridor):
    script = {key: [" fine </think> <answer>Right || Right</answer>"] * 3 for key in SCRIPT}
    episodes = play_with(make_config(), ScriptedBackend(script), [10], 1, prompt_mode="base")
    first_user = episodes[0].messages[1]["content"]
    assert first_user.startswith("Reach G.\n")
    base_format = "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
    assert f"Always output: {base_format} with no extra text." in first_user
    assert [t.executed for t in episodes[0].turns] == [["Right", "Right"], ["Right", "Right"]]
    assert episodes[0].success and episodes[0].turns[0].thoughts == "fine"


# ---- the VAGEN arm's state reward ---------------------------------------------------------------

VAGEN_SCRIPT = {"corridor-10-0": [
    # both states right
    (f" <observation>{state(0)}</observation> go <prediction>{state(2)}</prediction> </think> "
     "<answer>Right || Right</answer>"),
    # the observation right; the prediction's grid has 3 of its 5 cells right, and no coordinate line
    f" <observation>{state(2)}</observation> go <prediction>_P__G</prediction> </think> <answer>Right</answer>",
    # no states at all (and malformed): nothing to reward
    " <answer>Right</answer>",
]}


@pytest.mark.parametrize(("kind", "weights", "observation", "prediction"), [
    ("exact", (0.5, 0.5), [0.5, 0.5, 0.0], [0.5, 0.0, 0.0]),
    ("cells", (0.5, 0.5), [0.5, 0.5, 0.0], [0.5, 0.5 * 0.6, 0.0]),
    ("exact", (1.0, 2.0), [1.0, 1.0, 0.0], [2.0, 0.0, 0.0]),
])
def test_the_state_reward_scores_each_turns_states(corridor, kind, weights, observation, prediction):
    reward = StateReward(kind, *weights)
    [episode] = play_with(make_config(), ScriptedBackend(VAGEN_SCRIPT), [10], 1, state_reward=reward)
    assert [turn.state_reward_observation for turn in episode.turns] == pytest.approx(observation)
    assert [turn.state_reward_prediction for turn in episode.turns] == pytest.approx(prediction)
    expected = [o + p for o, p in zip(observation, prediction, strict=True)]
    assert [turn.state_reward for turn in episode.turns] == pytest.approx(expected)
    assert [turn.reward for turn in episode.turns] == pytest.approx([-0.2, -0.1, 0.0])
    assert episode.format_penalty == pytest.approx(-0.1)
    assert episode.total_reward == pytest.approx(-0.3 - 0.1 + sum(expected))  # PPO's score includes it
    assert episode.messages[3]["content"].startswith("Reward:\n-0.2\n")  # the prompt shows the env's reward
    first = episode.to_json()["turns"][0]
    assert (first["state_reward"], first["state_reward_prediction"]) == pytest.approx((expected[0], prediction[0]))


def test_the_state_reward_reads_states_written_under_the_base_prompt(corridor):
    """A world-model-trained policy writes its states inside the base prompt's think, and the base
    parser keeps them: the reward scores them too."""
    script = {"corridor-10-0": [
        (f" <observation>{state(0)}</observation> go <prediction>{state(1)}</prediction> </think> "
         "<answer>Right</answer>")] * 3}
    [episode] = play_with(make_config(), ScriptedBackend(script), [10], 1, prompt_mode="base",
                          state_reward=StateReward("exact", 0.5, 0.5))
    # turn 1 is right on both counts; later turns repeat the first turn's states, now both wrong
    assert [turn.state_reward for turn in episode.turns] == [1.0, 0.0, 0.0]
    assert episode.turns[0].format_ok


def test_no_state_reward_without_the_option(corridor):
    [episode] = play_with(make_config(), ScriptedBackend(VAGEN_SCRIPT), [10], 1)
    assert [turn.state_reward for turn in episode.turns] == [0.0, 0.0, 0.0]
    assert episode.total_reward == pytest.approx(-0.4)


def test_skip_ids_and_budget_override(corridor):
    backend = ScriptedBackend(SCRIPT)
    episodes = play_with(make_config(max_actions_per_traj=2), backend, [10, 11], 2,
                    skip_ids=frozenset({"corridor-10-0", "corridor-11-1"}))
    assert [e.id for e in episodes] == ["corridor-10-1", "corridor-11-0"]
    # a 2-action budget: the 11-0 episode ends after its first turn, truncated
    assert len(episodes[1].turns) == 1 and episodes[1].truncated
    assert "You can make up to 2 actions" in episodes[1].messages[1]["content"]


def test_waves_of_batch_size(corridor):
    _, backend = run_script(batch_size=3)
    # wave 1: 10-0 and 10-1 play 3 turns, 11-0 plays 2; wave 2: 11-1 plays 2
    assert backend.batches == [3, 3, 2, 1, 1]


def test_a_backend_that_holds_more_episodes_plays_waves_of_its_concurrency(corridor):
    """A vLLM engine plays as many episodes at once as its KV cache holds, whatever batch_size."""
    backend = ScriptedBackend(SCRIPT)
    backend.concurrency = 3
    play_with(make_config(batch_size=1), backend, [10, 11], 2)
    assert backend.batches == [3, 3, 2, 1, 1]
    backend = ScriptedBackend(SCRIPT)
    backend.concurrency = 8
    play_with(make_config(batch_size=1), backend, [10, 11], 2)
    assert backend.batches == [4, 4, 2]  # one wave: 11-0 and 11-1 end after turn 2


def test_each_request_has_a_seed_of_its_episode_and_turn_whatever_the_waves(corridor):
    seeds = []
    for batch_size in (1, 3, 4):
        _, backend = run_script(batch_size=batch_size)
        seeds.append(backend.seeds)
    assert seeds[0] == seeds[1] == seeds[2]
    assert len(set(seeds[0].values())) == len(seeds[0]) == 10  # a seed per episode and turn
    assert seeds[0][("corridor-10-1", 2)] == stable_seed(0, "corridor-10-1-2", bits=31)
    _, other = run_script(batch_size=4, sample_seed=1)
    assert set(other.seeds.values()).isdisjoint(seeds[0].values())


def test_only_the_last_allowed_turn_is_marked_last(corridor):
    _, backend = run_script()  # max_turns 3: two episodes end earlier, by the game
    assert backend.last_turns == {key: key[1] == 3 for key in backend.prompts}
    assert sum(backend.last_turns.values()) == 2


def test_a_puzzles_samples_share_one_n_request_on_their_first_turn(corridor, tokenizer):
    """Their first prompts are equal token for token: one request for the group, then one per
    episode; corridor 10 and 12 show equal prompts too, but are different puzzles."""
    _, backend = run_script(tokenizer)
    assert backend.keys[0] == [("corridor-10-0", "corridor-10-1"), ("corridor-11-0", "corridor-11-1")]
    assert all(len(keys) == 1 for call in backend.keys[1:] for keys in call)
    assert backend.prompts[("corridor-10-0", 1)] == backend.prompts[("corridor-10-1", 1)]
    backend = ScriptedBackend(SCRIPT | {"corridor-12-0": SCRIPT["corridor-10-0"]}, tokenizer)
    play_with(make_config(), backend, [10, 12], 1)
    assert backend.prompts[("corridor-10-0", 1)] == backend.prompts[("corridor-12-0", 1)]
    assert backend.keys[0] == [("corridor-10-0",), ("corridor-12-0",)]


def test_first_turn_seeds_are_the_puzzles_plus_the_sample_whatever_the_waves(corridor, tokenizer):
    """An n-request's i-th sample draws with seed + i: a sample's own first-turn seed, whether its
    group is one request (batch_size 4), is cut by a wave (3) or plays alone (1)."""
    seeds, calls = [], []
    for batch_size in (1, 3, 4):
        _, backend = run_script(tokenizer, batch_size=batch_size)
        seeds.append(backend.seeds)
        calls.append(backend.keys[0])
    assert seeds[0] == seeds[1] == seeds[2]
    assert calls == [[("corridor-10-0",)], [("corridor-10-0", "corridor-10-1"), ("corridor-11-0",)],
                     [("corridor-10-0", "corridor-10-1"), ("corridor-11-0", "corridor-11-1")]]
    for seed, sample in itertools.product((10, 11), (0, 1)):
        assert seeds[0][(f"corridor-{seed}-{sample}", 1)] == stable_seed(0, f"corridor-{seed}-1", bits=31) + sample
    assert len(set(seeds[0].values())) == len(seeds[0]) == 10


def test_samples_left_out_by_a_resume_break_the_n_request(corridor, tokenizer):
    """An n-request's seeds run on (seed + i): samples 0 and 2 of a puzzle are two requests."""
    script = {f"corridor-10-{sample}": SCRIPT["corridor-10-0"] for sample in range(3)}
    backend = ScriptedBackend(script, tokenizer)
    play_with(make_config(), backend, [10], 3, skip_ids=frozenset({"corridor-10-1"}))
    assert backend.keys[0] == [("corridor-10-0",), ("corridor-10-2",)]
    assert backend.seeds[("corridor-10-2", 1)] == stable_seed(0, "corridor-10-1", bits=31) + 2


@pytest.mark.parametrize("key,value", [("max_turns", 0), ("max_actions_per_turn", 0), ("batch_size", 0),
                                       ("max_actions_per_traj", 0), ("top_p", 0.0), ("history_window", -1)])
def test_bad_rollout_settings_are_user_errors(key, value):
    with pytest.raises(UserError, match=f"rollout.{key} must be"):
        load_config(None, [f"rollout.{key}={value}"])


def test_unknown_env_is_a_user_error():
    config = make_config()
    config.env.name = "sokobna"
    with pytest.raises(UserError, match="unknown env"):
        play_with(config, ScriptedBackend(SCRIPT), [10], 1)


# ---- token bookkeeping ---------------------------------------------------------------------------


def chatml(*messages: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)


def test_token_in_token_out(corridor, tokenizer):
    eos_turns = frozenset({("corridor-10-1", 2)})
    episodes, backend = run_script(tokenizer, eos_turns)
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    key = "corridor-10-0"
    # turn 1: the chat template's rendering of [system, user] + "<think>"
    prompt_1 = backend.prompts[(key, 1)]
    expected_1 = (chatml(("system", prompts.SYSTEM_PROMPT), ("user", USER_1))
                  + "<|im_start|>assistant\n<think>")
    assert tokenizer.decode(prompt_1) == expected_1
    assert prompt_1 == encode(expected_1)
    # turn 2: the turn-1 prompt + the sampled ids + the template's text between the turns
    delta = encode("<|im_end|>\n<|im_start|>user\n" + USER_2 + "<|im_end|>\n<|im_start|>assistant\n<think>")
    prompt_2 = backend.prompts[(key, 2)]
    assert prompt_2 == prompt_1 + backend.completions[(key, 1)] + delta
    assert tokenizer.decode(prompt_2) == (
        chatml(("system", prompts.SYSTEM_PROMPT), ("user", USER_1),
               ("assistant", "<think>" + SCRIPT[key][0]), ("user", USER_2))
        + "<|im_start|>assistant\n<think>"
    )
    # after a completion that ended with the end-of-turn token, the marker is not repeated
    key = "corridor-10-1"
    completion_2 = backend.completions[(key, 2)]
    assert completion_2[-1] == tokenizer.eos_token_id
    prompt_3 = backend.prompts[(key, 3)]
    assert prompt_3[len(backend.prompts[(key, 2)]) + len(completion_2)] != tokenizer.eos_token_id
    assert episodes[1].messages[4]["content"] == "<think>" + SCRIPT[key][1]  # no "<|im_end|>" inside
    for episode in episodes:
        assert_token_bookkeeping(episode, backend, tokenizer)


def assert_token_bookkeeping(episode: Episode, backend: ScriptedBackend, tokenizer) -> None:
    assert episode.single_sequence
    n = len(episode.token_ids)
    assert len(episode.response_mask) == n and len(episode.logprobs) == n
    # the whole sequence decodes to the chat template's rendering of the messages
    rendered = tokenizer.apply_chat_template(episode.messages, tokenize=False)
    decoded = tokenizer.decode(episode.token_ids)
    if episode.token_ids[-1] != tokenizer.eos_token_id:
        decoded += "<|im_end|>\n"
    else:
        decoded += "\n"
    assert decoded == rendered
    # the mask is 1 exactly on the sampled tokens, in order, with their log-probs
    completions = [backend.completions[(episode.id, k + 1)] for k in range(len(episode.turns))]
    sampled = [t for t, m in zip(episode.token_ids, episode.response_mask) if m]
    assert sampled == [t for ids in completions for t in ids]
    assert [episode.token_ids[a:b] for a, b in episode.turn_spans] == completions
    assert all((lp == -0.5) == bool(m) for lp, m in zip(episode.logprobs, episode.response_mask))
    # each turn's prompt is a prefix of the final sequence
    for k in range(len(episode.turns)):
        prompt = backend.prompts[(episode.id, k + 1)]
        assert episode.token_ids[:len(prompt)] == prompt
        assert episode.turn_spans[k][0] == len(prompt)


def test_history_window_rebuilds_the_prompt(corridor, tokenizer):
    episodes, backend = run_script(tokenizer, history_window=1)
    episode = episodes[0]
    assert not episode.single_sequence and episode.token_ids == []
    assert len(episode.segments) == 3
    # turn 3 sees the instruction, turn 2's block and answer, and turn 3's block; turn 1 is gone
    user_2_block = USER_2.split("\n", 2)[2]  # without the "Reward:\n-0.2\n" of turn 1
    prefix = USER_1.split("\nTurn 1:")[0]
    expected = chatml(("system", prompts.SYSTEM_PROMPT), ("user", prefix + user_2_block),
                      ("assistant", "<think>" + SCRIPT["corridor-10-0"][1]),
                      ("user", episode.messages[5]["content"])) + "<|im_start|>assistant\n<think>"
    assert tokenizer.decode(backend.prompts[("corridor-10-0", 3)]) == expected
    assert episode.segments[2].prompt_ids == backend.prompts[("corridor-10-0", 3)]
    assert episode.segments[2].completion_ids == backend.completions[("corridor-10-0", 3)]
    # the stored chat is still the whole conversation
    assert len(episode.messages) == 7
    # window 0: every prompt is the instruction and the current turn only
    episodes, backend = run_script(tokenizer, history_window=0)
    decoded = tokenizer.decode(backend.prompts[("corridor-10-0", 2)])
    assert decoded.count("<|im_start|>user") == 1 and "Turn 2:" in decoded and "Turn 1:" not in decoded


def test_the_meter_counts_each_turn_and_gives_up_the_turns_an_episode_did_not_play():
    from stages.agent.backends.random import RandomBackend
    from stages.common.console import Progress

    config = SPAConfig()  # sokoban, 5 turns: 3 random actions a turn use its budget of 10 in 4
    bar = Progress("generate", 0, 0)
    meter = RolloutMeter(bar)
    episodes = play_with(config, RandomBackend("world_model"), [0, 1], 3, meter=meter)
    played = sum(len(episode.turns) for episode in episodes)
    assert meter.total == 6 * 5 and played < meter.total
    assert meter.done == bar.done == bar.total == meter.total  # the unplayed turns given up
    assert (meter.episodes, meter.solved, meter.tokens) == (6, sum(e.success for e in episodes), 0)
    assert meter.figures() == f"episodes 6/6 ({meter.solved} solved)"


# ---- real games -----------------------------------------------------------------------------------


class SudokuSolver:
    """Fills the first blanks from the env's solution, five a turn."""

    name = "solver"

    def generate(self, requests, params, progress=None):
        out = []
        for request in requests:
            env = request.env
            blanks = [(r, c) for r in range(4) for c in range(4) if not env.board[r][c]]
            moves = " || ".join(f"{r + 1},{c + 1},{env.solution[r][c]}" for r, c in blanks[:5])
            out.append(Completion([], wm(moves)))
        return out

    def release(self, keys):
        pass


def test_sudoku_solved_in_two_turns():
    config = SPAConfig()
    config.env.name = "sudoku"
    episodes = play_with(config, SudokuSolver(), [123, 124], 1)
    for episode in episodes:
        assert [len(t.executed) for t in episode.turns] == [5, 1]
        assert [t.reward for t in episode.turns] == [0.0, 1.0]
        assert episode.success and episode.total_reward == 1.0 and episode.format_penalty == 0.0
        assert "No empty positions found" in episode.turns[-1].next_state
        assert "You have 45 actions left." in episode.messages[3]["content"]


class RandomText:
    """Random action names and some junk, so every path of the loop runs on the real games."""

    name = "random-text"

    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def generate(self, requests, params, progress=None):
        out = []
        for request in requests:
            env = request.env
            actions = [env.sample_action(self.rng) for _ in range(self.rng.randint(0, 6))]
            if self.rng.random() < 0.2:
                actions.append("Jump")
            text = wm(" || ".join(actions)) if self.rng.random() < 0.9 else " no format"
            out.append(Completion([], text))
        return out

    def release(self, keys):
        pass


@pytest.mark.parametrize("name", ["sokoban", "frozen_lake", "sudoku"])
def test_real_games_invariants(name):
    config = SPAConfig()
    config.env.name = name
    episodes = play_with(config, RandomText(), [7, 8, 9], 3)
    assert len(episodes) == 9
    game = envs.make(name)
    budget = game.max_actions_per_traj
    for episode in episodes:
        turns = episode.turns
        assert 1 <= len(turns) <= 5 and turns[-1].done and not any(t.done for t in turns[:-1])
        for before, after in itertools.pairwise(turns):
            assert before.next_state == after.state
        assert sum(len(t.executed) for t in turns) <= budget
        for t in turns:
            assert len(t.actions) <= 5
            valid = [a for a in map(game.parse_action, t.actions) if a is not None]
            bad_turn = not t.format_ok or not valid or len(valid) < len(t.actions)
            assert t.penalty == (-0.1 if bad_turn else 0.0)
            assert t.executed == valid[:len(t.executed)]
            if not t.executed:
                assert t.next_state == t.state
        assert episode.total_reward == sum(t.reward for t in turns) + episode.format_penalty
        assert episode.messages[-1]["role"] == "assistant"
        assert len([m for m in episode.messages if m["role"] == "assistant"]) == len(turns)
    # a group plays one puzzle
    assert len({e.turns[0].state for e in episodes if e.seed == 7}) == 1


def test_sampling_params_follow_the_config_with_a_seed_per_call(corridor):
    seeds_by_run = []
    for _ in range(2):
        backend = ScriptedBackend(SCRIPT)
        play_with(make_config(max_new_tokens=77, temperature=0.7, top_p=0.9), backend, [10, 11], 2)
        calls = backend.params
        assert {(p.max_new_tokens, p.temperature, p.top_p, p.stop) for p in calls} == {
            (77, 0.7, 0.9, ("</answer>",))}
        seeds_by_run.append([p.seed for p in calls])
    assert seeds_by_run[0] == seeds_by_run[1]  # reproducible
    assert len(set(seeds_by_run[0])) == len(seeds_by_run[0])  # but not one seed for every turn


def test_template_that_rewrites_history_needs_a_window(corridor, tokenizer):
    import copy

    hiding = copy.deepcopy(tokenizer)
    hiding.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}(hidden){% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(UserError, match="history_window"):
        run_script(hiding)
    episodes, backend = run_script(hiding, history_window=5)
    assert "(hidden)" in hiding.decode(backend.prompts[("corridor-10-0", 2)])
    assert [len(e.segments) for e in episodes] == [3, 3, 2, 2]
