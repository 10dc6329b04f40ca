"""`spa ppo` end to end on a tiny random model: artifacts, resume, bad input (learning:
tests/test_ppo_learning.py)."""

import io
import json
import math
import types
from pathlib import Path

import pytest
import torch
from helpers import assert_same_weights, live_modules
from safetensors.torch import load_file

from stages import ppo
from stages.common.config import load_config
from stages.common.errors import UserError
from stages.common.seeds import stable_seed
from stages.training import ppo_samples


def tiny_config(model_dir, out, *extra):
    return load_config(None, [
        f"model.name={model_dir}", f"ppo.out={out}", "quiet=true",
        "rollout.groups=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "rollout.max_turns=2",
        "ppo.steps=2", "ppo.filter_ratio=1.0", "ppo.mini_batch=2", "ppo.micro_batch_tokens=1024",
        "ppo.save_every=1", "ppo.val_every=0", "ppo.actor_lr=1e-3", "ppo.critic_lr=1e-3",
        *extra,
    ])


def read_metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_rl_seeds_draw_other_samples_of_the_same_puzzles_and_the_default_seed_adds_nothing(tmp_path):
    def sampler_seeds(seed):
        config = tiny_config("smollm2-135m", tmp_path, "rollout.sample_seed=7", f"ppo.seed={seed}")
        return [ppo.rollout_config(config, step).sample_seed for step in (1, 2)]

    assert sampler_seeds(1) == [stable_seed(7, "ppo", step, bits=31) for step in (1, 2)]
    assert sampler_seeds(2) == [stable_seed(7, "ppo", step, "seed-2", bits=31) for step in (1, 2)]
    assert len({*sampler_seeds(1), *sampler_seeds(2), *sampler_seeds(3)}) == 6
    config = tiny_config("smollm2-135m", tmp_path, "ppo.seed=2")
    assert ppo.train_seeds(config, 4) == ppo.train_seeds(tiny_config("smollm2-135m", tmp_path), 4) == [10004, 10005]


TRAIN_FIELDS = ("reward", "success", "entropy", "clip_frac", "ppo_kl", "value_loss", "pg_loss",
                "response_length", "distinct_in_group", "distinct_responses", "repeated_ngrams", "input_dependence",
                "logp_diff", "seconds_rollout", "seconds_old_logprobs", "seconds_values",
                "seconds_update", "update_tokens_per_s", "actor_grad_norm", "critic_grad_norm", "peak_rss_gb")


def two_turn_episode():
    """Tokens: system 0-2, user 3-4, turn 1 = 5-6, env reply 7-8, turn 2 = 9-11."""
    from stages.agent.episode import Episode, Turn

    turn = {"state": "s", "response": "r", "observation": None, "prediction": None, "thoughts": None,
            "actions": [], "executed": [], "next_state": "s", "format_ok": False, "done": False}
    episode = Episode("e", "sokoban", 5, group=3, sample=0, prompt_mode="base", render_mode="coords", model="m")
    episode.token_ids = list(range(100, 112))
    episode.response_mask = [0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    episode.logprobs = [0.0] * 5 + [-1.0, -2.0] + [0.0] * 2 + [-3.0, -4.0, -5.0]
    episode.turn_spans = [(5, 7), (9, 12)]
    episode.turns = [Turn(**turn, reward=0.5, penalty=-0.1), Turn(**turn, reward=1.0, penalty=0.0)]
    episode.total_reward = 1.4
    return episode


def test_sample_with_the_assistant_mask_has_the_sampled_tokens_as_steps():
    sample = ppo_samples.to_sample(two_turn_episode(), "assistant", system_length=3)
    assert sample.positions.tolist() == [5, 6, 9, 10, 11]
    assert sample.sampled.all()
    assert sample.sampler_logprobs.tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert sample.rewards.tolist() == pytest.approx([0, 0, 0, 0, 1.4])  # the score on the last sampled token
    assert sample.turn_rewards.tolist() == pytest.approx([0, 0.4, 0, 0, 1.0])  # reward + penalty per turn
    assert sample.turn_ends.tolist() == [False, True, False, False, True]
    assert (sample.score, sample.group) == (pytest.approx(1.4), 3)


def three_turn_episode():
    """Tokens: system 0-1, user 2, turn 1 = 3-4, env reply 5, turn 2 = 6-7, env reply 8, turn 3 = 9-10.

    Turn rewards (env reward + format penalty + state reward's observation and prediction parts):
    turn 1: 0 + 0 + 0.5 + 0.25 = 0.75; turn 2: 0 - 0.25 + 0.5 + 0 = 0.25; turn 3: 1 + 0 + 0 + 0.5 = 1.5.
    """
    from stages.agent.episode import Episode, Turn

    turn = {"state": "s", "response": "r", "observation": "o", "prediction": "p", "thoughts": None,
            "actions": [], "executed": [], "next_state": "s", "format_ok": True, "done": False}
    episode = Episode("e", "sokoban", 5, group=0, sample=0, prompt_mode="world_model", render_mode="coords",
                      model="m")
    episode.token_ids = list(range(100, 111))
    episode.response_mask = [0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    episode.logprobs = None
    episode.turn_spans = [(3, 5), (6, 8), (9, 11)]
    episode.turns = [
        Turn(**turn, reward=0.0, penalty=0.0, state_reward_observation=0.5, state_reward_prediction=0.25),
        Turn(**turn, reward=0.0, penalty=-0.25, state_reward_observation=0.5, state_reward_prediction=0.0),
        Turn(**turn, reward=1.0, penalty=0.0, state_reward_observation=0.0, state_reward_prediction=0.5),
    ]
    episode.total_reward = 2.5
    return episode


def test_each_turns_state_reward_sits_on_that_turns_last_token():
    sample = ppo_samples.to_sample(three_turn_episode(), "assistant", system_length=2)
    assert sample.positions.tolist() == [3, 4, 6, 7, 9, 10]
    assert sample.turn_ends.tolist() == [False, True, False, True, False, True]
    assert sample.turn_rewards.tolist() == [0.0, 0.75, 0.0, 0.25, 0.0, 1.5]
    assert sample.rewards.tolist() == [0.0] * 5 + [2.5]  # token-level GAE: the whole score at the end
    every = ppo_samples.to_sample(three_turn_episode(), "all", system_length=2)  # env tokens are steps too
    assert every.turn_rewards.tolist() == [0.0, 0.0, 0.75, 0.0, 0.0, 0.25, 0.0, 0.0, 1.5]


# Values on the six steps; each turn is valued at its last token: U1 = 1, U2 = 0.5, U3 = 2.
THREE_TURN_VALUES = [0.5, 1.0, 0.25, 0.5, 1.0, 2.0]


@pytest.mark.parametrize(("gamma", "lam", "turn_gamma", "advantages"), [
    # Turn level: Â3 = 1.5 - 2 = -0.5; Â2 = 0.25 + 2 - 0.5 + Â3 = 1.25; Â1 = 0.75 + 0.5 - 1 + Â2 = 1.5.
    # Token level: A(last of turn k) = Â_k; A(first) = (V_last - V_first) + Â_k: the reward-to-go minus V.
    (1.0, 1.0, 1.0, [2.0, 1.5, 1.5, 1.25, 0.5, -0.5]),
    # Â3 = -0.5; Â2 = (0.25 + 0.5*2 - 0.5) + 0.25*Â3 = 0.625; Â1 = (0.75 + 0.5*0.5 - 1) + 0.25*Â2 = 0.15625.
    # A(first) = (0.5*V_last - V_first) + 0.25*Â_k: 0.0390625, 0.15625, -0.125.
    (0.5, 0.5, 0.5, [0.0390625, 0.15625, 0.15625, 0.625, -0.125, -0.5]),
    # The same turn level; A(first) = (V_last - V_first) + 0.5*Â_k: 0.578125, 0.5625, 0.75.
    (1.0, 0.5, 0.5, [0.578125, 0.15625, 0.5625, 0.625, 0.75, -0.5]),
    # The turn level of the first case; A(first) = (0.5*V_last - V_first) + 0.5*Â_k: 0.75, 0.625, -0.25.
    (0.5, 1.0, 1.0, [0.75, 1.5, 0.625, 1.25, -0.25, -0.5]),
])
def test_bilevel_gae_on_a_three_turn_episode_against_hand_computation(gamma, lam, turn_gamma, advantages):
    from stages.common.config import PPOConfig
    from stages.training import ppo_algos

    sample = ppo_samples.to_sample(three_turn_episode(), "assistant", system_length=2)
    values = torch.tensor(THREE_TURN_VALUES)
    raw, returns = ppo_algos.bilevel_gae(sample.turn_rewards[None], values[None], torch.ones(1, 6),
                                         sample.turn_ends[None], gamma, lam, turn_gamma)
    assert raw[0].tolist() == advantages  # dyadic numbers: exact in float32
    assert returns[0].tolist() == [a + v for a, v in zip(advantages, THREE_TURN_VALUES, strict=True)]
    # the turn's return G_k = Â_k + U_k is the critic's target at the turn's last token
    sample.values = values
    ppo_samples.compute_advantages([sample], PPOConfig(advantage="bilevel_gae", gamma=gamma, lam=lam,
                                                       turn_gamma=turn_gamma))
    assert sample.returns.tolist() == returns[0].tolist()
    expected = torch.tensor(advantages)
    whitened = (expected - expected.mean()) / (expected.var() + 1e-8).sqrt()
    torch.testing.assert_close(sample.advantages, whitened)


def test_a_step_logs_the_state_reward_it_paid():
    episodes = [three_turn_episode(), three_turn_episode()]
    for turn in episodes[1].turns:
        turn.state_reward_observation = turn.state_reward_prediction = 0.0
    figures = [ppo.episode_figures(e) for e in episodes]
    assert (figures[0]["state_reward_observation"], figures[0]["state_reward_prediction"]) == (1.0, 0.75)
    samples = [ppo_samples.to_sample(e, "assistant", system_length=2) for e in episodes]
    stats = ppo.rollout_stats(figures, episodes, samples, state_reward=True)
    assert (stats["state_reward"], stats["state_reward_observation"], stats["state_reward_prediction"]) == (
        0.875, 0.5, 0.375)
    assert "state_reward" not in ppo.rollout_stats(figures, episodes, samples)


#: Three Sokoban boards, one move apart: the player steps right, then pushes the box right.
BOARDS = ("#######\n#P_X_O#\n#######", "#######\n#_PX_O#\n#######", "#######\n#__PXO#\n#######")


def test_a_step_logs_how_often_its_rollouts_observed_and_predicted_the_game_exactly():
    """World-model accuracy during RL, on turns whose states are known: an observation or prediction
    counts where it equals the truth after `normalize_state` (trailing spaces aside); a prediction that
    copies the observation is exact on a move into a wall and wrong on a move that changed the board,
    which only the turns that changed the state tell apart."""
    one, two, three = BOARDS
    episodes = [three_turn_episode(), three_turn_episode()]
    written = [  # (state, next_state, observation, prediction) of each turn
        [(one, two, one.replace("\n", "  \n"), two),  # both exact, the board changed
         (two, two, one, two),  # a wrong observation; a move into a wall, predicted (a copy)
         (two, three, None, None)],  # no tags
        [(one, two, one, one),  # the board changed; a copy of the observation predicted
         (two, three, two, three),  # both exact, the board changed
         (three, three, None, two)],  # a wrong prediction, the board unchanged
    ]
    for episode, turns in zip(episodes, written):
        for turn, (state, next_state, observation, prediction) in zip(episode.turns, turns):
            turn.state, turn.next_state, turn.observation, turn.prediction = state, next_state, observation, prediction
    figures = [ppo.episode_figures(e) for e in episodes]
    samples = [ppo_samples.to_sample(e, "assistant", system_length=2) for e in episodes]
    stats = ppo.rollout_stats(figures, episodes, samples)
    assert {key: stats[key] for key in stats if key.startswith("wm_")} == {
        "wm_observation_exact": 3 / 4, "wm_observation_turns": 4,  # all but the first episode's second
        "wm_prediction_exact": 3 / 5, "wm_prediction_turns": 5,  # all but the second episode's first and last
        "wm_prediction_of_change_exact": 2 / 3, "wm_prediction_of_change_turns": 3,  # the copy is wrong here
        # these boards are grids alone: the grid is the whole state, and no coordinates are judged
        "wm_observation_grid_exact": 3 / 4, "wm_prediction_grid_exact": 3 / 5, "wm_prediction_of_change_grid_exact": 2 / 3,
        "wm_observation_coordinates_exact": None, "wm_prediction_coordinates_exact": None,
        "wm_prediction_of_change_coordinates_exact": None,
    }
    for turn in [turn for episode in episodes for turn in episode.turns]:  # the base prompt's turns: no tags
        turn.observation = turn.prediction = None
    stats = ppo.rollout_stats([ppo.episode_figures(e) for e in episodes], episodes, samples)
    assert {key: stats[key] for key in stats if key.startswith("wm_")} == {
        **{f"wm_{kind}_{figure}": None for kind in ppo.WORLD_MODEL_KINDS
           for figure in ("exact", "grid_exact", "coordinates_exact")},
        "wm_observation_turns": 0, "wm_prediction_turns": 0, "wm_prediction_of_change_turns": 0}


def test_sample_with_the_all_mask_covers_everything_after_the_system_prompt():
    sample = ppo_samples.to_sample(two_turn_episode(), "all", system_length=3)
    assert sample.positions.tolist() == list(range(3, 12))
    assert sample.sampled.tolist() == [False, False, True, True, False, False, True, True, True]
    assert sample.rewards[-1] == pytest.approx(1.4) and sample.rewards[:-1].abs().sum() == 0


def test_system_prompt_length_on_the_bundled_template(tokenizer):
    from stages.agent import prompts

    chat = [{"role": "system", "content": prompts.SYSTEM_PROMPT}, {"role": "user", "content": "Turn 1"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    length = ppo_samples.system_prompt_length(tokenizer, ids)
    assert tokenizer.decode(ids[:length]).endswith(prompts.SYSTEM_PROMPT + "<|im_end|>\n")
    assert "Turn 1" in tokenizer.decode(ids[length:])


def test_micro_batches_group_by_length_within_the_token_budget():
    samples = [ppo_samples.Sample(torch.zeros(n, dtype=torch.long), *([None] * 6), score=0.0, group=0)
               for n in (5, 3, 9, 4)]
    groups = ppo_samples.micro_batches(samples, token_budget=10)
    assert [[len(row[0].ids) for row in group] for group in groups] == [[3, 4], [5], [9]]
    assert [len(g) for g in ppo_samples.micro_batches(samples, token_budget=4)] == [1, 1, 1, 1]  # too long: alone


@pytest.fixture(scope="module")
def two_steps(tiny_model_dir, tmp_path_factory):
    """An uninterrupted 2-step run, validated before training and at the end."""
    out = tmp_path_factory.mktemp("ppo") / "run"
    config = tiny_config(tiny_model_dir, out, "ppo.val_every=2", "eval.seeds=1", "eval.pass_k=2")
    return ppo.run(config), out


def test_tiny_run_writes_metrics_checkpoints_and_validation(two_steps, tokenizer):
    from transformers import AutoModelForCausalLM

    summary, out = two_steps
    assert summary["steps"] == 2
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert {"val_pass@1", "val_pass@2"} <= set(rows[0]) and {"val_pass@1", "val_pass@2"} <= set(rows[2])
    for row in rows[1:]:
        for field in TRAIN_FIELDS:
            assert math.isfinite(row[field]), (field, row[field])
        assert row["kept_episodes"] == 4
        assert row["seed_counter"] == 2 * row["step"]  # 2 fresh train seeds per step
        assert row["logp_diff"] < 1e-3  # the trainer recomputes the sampler's log-probs
        assert 0 <= row["clip_frac"] <= 1
        for kind in ppo.WORLD_MODEL_KINDS:  # a share where some turn wrote the tag, null where none did
            turns, exact = row[f"wm_{kind}_turns"], row[f"wm_{kind}_exact"]
            assert (exact is None) if turns == 0 else (0 <= exact <= 1), (kind, turns, exact)
    # the process's peak so far, at each step and at the end: it never goes down
    assert 0 < rows[1]["peak_rss_gb"] <= rows[2]["peak_rss_gb"] <= summary["peak_rss_gb"]
    assert rows[1]["value_loss"] > 0
    # Checkpoints: step-1 and final/ are HF directories; trainer_state/ is the newest resumable state.
    assert (out / "step-1" / "model.safetensors").is_file() and not (out / "step-1" / "trainer_state").exists()
    state_dir = out / "trainer_state"
    for name in ("progress.json", "actor", "critic"):
        assert (state_dir / name).exists(), name
    progress = json.loads((state_dir / "progress.json").read_text())
    assert progress == {"step": 2, "seed_counter": 4}
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    initial = AutoModelForCausalLM.from_pretrained(ppo_model_dir(out))
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), initial.parameters()))  # it trained
    ids = tokenizer("hello", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    assert (out / "val" / "step-0.json").is_file() and (out / "val" / "step-2.json").is_file()


def test_val_before_train_off_validates_only_after_training(tiny_model_dir, tmp_path):
    """ppo.val_before_train=false: no step-0 row or report; the last step still validates."""
    out = tmp_path / "run"
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.steps=1", "ppo.zero_stage=0", "rollout.max_turns=1",
                        "ppo.val_every=1", "ppo.val_before_train=false", "eval.seeds=1", "eval.pass_k=1"))
    [row] = read_metrics(out)
    assert row["step"] == 1 and "val_pass@1" in row
    assert sorted(path.name for path in (out / "val").glob("step-*[0-9].json")) == ["step-1.json"]


def test_offload_and_a_deepspeed_config_reach_both_training_engines(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The training settings PPO shares with SFT go to the actor's and the critic's engine alike;
    on the CPU with plain torch offload puts each network's optimizer state in a file in the run
    directory between its steps, which the opening line says."""
    from stages.training import trainable

    seen, engines, make_engine = [], [], trainable.make_engine

    def spy(module, dist, mixed, zero_stage, optim, offload=False, deepspeed_config="", out=None):
        seen.append((type(module).__name__, zero_stage, offload, deepspeed_config, out))
        engines.append(make_engine(module, dist, mixed, zero_stage, optim, offload, deepspeed_config, out))
        return engines[-1]

    monkeypatch.setattr(trainable, "make_engine", spy)
    ds_config = tmp_path / "ds.json"
    ds_config.write_text("{}")  # plain torch reads none: what is checked is where it goes
    run = tmp_path / "run"
    ppo.run(tiny_config(tiny_model_dir, run, "ppo.steps=1", "ppo.zero_stage=0", "ppo.offload=true",
                        f"ppo.deepspeed_config={ds_config}", "quiet=false"))
    assert seen == [("StepPolicy", 0, True, str(ds_config), run), ("ValueModel", 0, True, str(ds_config), run)]
    assert "plain torch, optimizer state on disk on cpu" in capsys.readouterr().out
    for engine in engines:  # stepped, its moments parked, and the file closed at the end
        assert engine.on_disk.parked and engine.on_disk.file.closed
        assert all(value.dim() == 0 for state in engine.optimizer.state.values() for value in state.values())


def test_the_default_engine_of_one_cpu_process_is_plain_torch_and_the_run_records_it(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    """`ppo.zero_stage: auto` trains one CPU process with plain torch (ZeRO has no other rank to shard
    over); the run's manifest names the engine it trained with, and a launcher's ranks get ZeRO-2."""
    from stages.training import trainable

    seen, make_engine = [], trainable.make_engine

    def spy(module, dist, mixed, zero_stage, optim, offload=False, deepspeed_config="", out=None):
        seen.append(zero_stage)
        return make_engine(module, dist, mixed, zero_stage, optim, offload, deepspeed_config, out)

    monkeypatch.setattr(trainable, "make_engine", spy)
    config = tiny_config(tiny_model_dir, tmp_path / "run", "ppo.steps=1", "rollout.max_turns=1")
    assert config.ppo.zero_stage == "auto"
    ppo.run(config)
    assert seen == [0, 0]  # actor and critic
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["config"]["ppo"]["zero_stage"] == 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert trainable.with_engine_stage(config, "ppo").ppo.zero_stage == 2


def test_the_last_step_validates_off_the_val_every_grid(tiny_model_dir, tmp_path):
    """With val_every > 0 the last step validates whether or not it falls on the grid (verl's
    behaviour); the steps off the grid before it do not."""
    out = tmp_path / "run"
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.steps=2", "ppo.zero_stage=0", "rollout.max_turns=1",
                        "ppo.val_every=3", "ppo.val_before_train=false", "eval.seeds=1", "eval.pass_k=1"))
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [1, 2]
    assert "val_pass@1" not in rows[0] and "val_pass@1" in rows[1]
    assert sorted(path.name for path in (out / "val").glob("step-*[0-9].json")) == ["step-2.json"]
    assert (out / "final" / "model.safetensors").is_file()
    report = json.loads((out / "val" / "step-2.json").read_text())
    episodes = (out / "val" / "step-2.trajectories.jsonl").read_text().splitlines()
    assert report["settings"]["model"] == f"{out} (step 2)"  # the live actor, not the starting model
    assert {json.loads(line)["model"] for line in episodes} == {f"{out} (step 2)"}


def test_a_step_shows_its_rollout_turns_then_its_update(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from stages.common import console

    log = io.StringIO()  # a log file, not a terminal: plain progress lines
    monkeypatch.setattr(console.sys, "stderr", log)
    monkeypatch.setattr(console, "LOG_EVERY_S", 0.0)  # a line for every update
    out = tmp_path / "run"
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.steps=1", "ppo.zero_stage=0", "quiet=false"))
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith(f"ppo: {tiny_model_dir} on sokoban (") and header.endswith(
        f"hf rollouts, plain torch on cpu (fp32); -> {out}; from the start")
    lines = [line.split("; ")[0] for line in log.getvalue().splitlines() if line.startswith("ppo")]
    rollout = [line for line in lines if "step 1: rollout" in line]
    # 4 episodes of 2 turns: the turns count as the backend returns them, within the step
    assert [line.split(" rollout ")[1].split(" turns")[0] for line in rollout][-1] == "8/8"
    assert any(" rollout 4/8 turns, episodes 0/4" in line for line in rollout)
    assert lines.index(rollout[-1]) < lines.index("ppo: 0/1 steps (0%) step 1: update on 4 episodes")
    assert lines[-1].startswith("ppo: 1/1 steps (100%) reward ")


def ppo_model_dir(out):
    return json.loads((Path(out) / "manifest.json").read_text())["config"]["model"]["name"]


def test_resume_after_one_step_equals_an_uninterrupted_run(two_steps, tiny_model_dir, tmp_path):
    _, full_out = two_steps
    out = tmp_path / "run"
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.steps=1"))
    assert json.loads((out / "trainer_state" / "progress.json").read_text())["step"] == 1
    summary = ppo.run(tiny_config(tiny_model_dir, out, "ppo.resume=true"))
    assert summary["steps"] == 2
    resumed = {row["step"]: row for row in read_metrics(out)}
    full = {row["step"]: row for row in read_metrics(full_out)}
    assert sorted(resumed) == [1, 2]
    for step in (1, 2):
        for field in ("reward", "response_length", "sequence_length", "seed_counter", "pg_loss", "value_loss",
                      "entropy", "ppo_kl", "actor_grad_norm", "critic_grad_norm"):
            assert resumed[step][field] == pytest.approx(full[step][field], rel=1e-4, abs=1e-6), (step, field)
    from safetensors.torch import load_file

    a, b = load_file(out / "final" / "model.safetensors"), load_file(full_out / "final" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)


def test_existing_out_without_resume_is_refused(two_steps, tiny_model_dir):
    _, out = two_steps
    with pytest.raises(UserError, match=r"already holds a ppo run; add --resume to continue it, or choose another"):
        ppo.run(tiny_config(tiny_model_dir, out))


def test_resume_of_a_finished_run_does_nothing(two_steps, tiny_model_dir):
    _, out = two_steps
    before = (out / "metrics.jsonl").read_text()
    summary = ppo.run(tiny_config(tiny_model_dir, out, "ppo.resume=true", "ppo.val_every=2", "eval.seeds=1",
                                  "eval.pass_k=2"))
    assert summary["steps"] == 2
    assert (out / "metrics.jsonl").read_text() == before


def test_a_run_without_its_final_state_trains_alike_and_cannot_be_extended(two_steps, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    _, full_out = two_steps
    out = tmp_path / "run"
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.final_state=false", "ppo.save_every=100"))
    assert sorted(p.name for p in (out / "trainer_state").iterdir()) == ["progress.json"]
    assert json.loads((out / "trainer_state" / "progress.json").read_text())["step"] == 2
    ours, full = load_file(out / "final" / "model.safetensors"), load_file(full_out / "final" / "model.safetensors")
    assert all(torch.equal(ours[key], full[key]) for key in full)  # the same training: only the saving differs
    before = (out / "metrics.jsonl").read_text()
    assert ppo.run(tiny_config(tiny_model_dir, out, "ppo.resume=true", "ppo.final_state=false"))["steps"] == 2
    assert (out / "metrics.jsonl").read_text() == before
    with pytest.raises(UserError, match=(r"finished at step 2 without its optimizer state \(ppo.final_state was "
                                         r"false\), so it cannot go on to step 3; train on from .*final in a new run")):
        ppo.run(tiny_config(tiny_model_dir, out, "ppo.resume=true", "ppo.steps=3"))


@pytest.mark.parametrize("overrides, message", [
    (["ppo.mini_batch=3"], (r"ppo.mini_batch=3 does not divide the episodes kept per step: rollout.groups=2 x "
                            r"ppo.filter_ratio=1.0 -> 2 groups x rollout.group_size=2 = 4")),
    (["ppo.filter_ratio=0.25"], r"ppo.filter_ratio=0.25 keeps no group out of rollout.groups=2"),
    (["rollout.backend=random"], r"rollout.backend must be hf or vllm"),
    (["rollout.temperature=0"], r"rollout.temperature must be > 0"),
    (["ppo.advantage=grpo", "rollout.group_size=1", "ppo.mini_batch=1"], r"group_size must be >= 2"),
])
def test_bad_settings_fail_with_one_line(tiny_model_dir, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message) as info:
        ppo.run(tiny_config(tiny_model_dir, tmp_path / "run", *overrides))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_that_is_not_a_causal_lm_is_refused(tmp_path):
    from transformers import ViTConfig, ViTModel

    ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                       image_size=8, patch_size=4)).save_pretrained(tmp_path / "vit")
    with pytest.raises(UserError, match=r"cannot load a causal LM"):
        ppo.run(tiny_config(tmp_path / "vit", tmp_path / "run"))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    real_update, real_loss = ppo.update, ppo.algos.policy_loss
    current = {}

    def update(*args, **kwargs):
        current["step"] = args[-1]
        return real_update(*args, **kwargs)

    def poisoned(*args, **kwargs):  # the policy loss of step 2 is NaN
        loss, stats = real_loss(*args, **kwargs)
        return (loss * float("nan") if current["step"] == 2 else loss), stats

    monkeypatch.setattr(ppo, "update", update)
    monkeypatch.setattr(ppo.algos, "policy_loss", poisoned)
    out = tmp_path / "run"
    with pytest.raises(ppo.NonFiniteLoss, match=r"the policy loss became nan at step 2; training stopped"):
        ppo.run(tiny_config(tiny_model_dir, out))
    assert json.loads((out / "trainer_state" / "progress.json").read_text())["step"] == 1
    assert not (out / "final").exists()
    assert [row["step"] for row in read_metrics(out)] == [1]
    monkeypatch.undo()  # the cause is gone: --resume goes on from step 1
    assert ppo.run(tiny_config(tiny_model_dir, out, "ppo.resume=true"))["steps"] == 2
    assert [row["step"] for row in read_metrics(out)] == [1, 2]


def test_resume_before_the_first_checkpoint_starts_afresh(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    (out / "val").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0, "val_pass@1": 0.0}\n{"step": 1, "reward": 5.0}\n')
    (out / "val" / "step-0.json").write_text("{}")
    (out / ".trainer_state.tmp" / "actor").mkdir(parents=True)  # a save killed half-way
    config = tiny_config(tiny_model_dir, out, "ppo.resume=true", "ppo.steps=1")
    from stages.common import runs
    from stages.training import trainable

    # what the killed run had recorded at its start (the engine it trained with)
    runs.record(out, "ppo", {}, ppo.settings(trainable.with_engine_stage(config, "ppo")))
    ppo.run(config)
    assert [row["step"] for row in read_metrics(out)] == [1]
    assert read_metrics(out)[0]["reward"] != 5.0
    assert not (out / "val" / "step-0.json").exists() and not (out / ".trainer_state.tmp").exists()


def test_a_finished_run_leaves_no_model_behind(tiny_model_dir, tmp_path):
    """ZeRO's gradient hooks keep the engine alive unless it is destroyed: `spa pipeline` runs its
    stages in one process, and every PPO arm's actor, critic, reference and Adam state stayed."""
    before = live_modules()
    ppo.run(tiny_config(tiny_model_dir, tmp_path / "run", "ppo.steps=1", "ppo.zero_stage=2", "ppo.kl_coef=0.1"))
    assert live_modules() == before


@pytest.mark.parametrize("low_memory", [True, False])
def test_the_critic_steps_before_the_actors_backward_so_their_gradients_never_coexist(
        tiny_model_dir, tmp_path, monkeypatch, low_memory):
    seen = []
    real_critic_backward, real_actor_backward = ppo._critic_backward, ppo._actor_backward

    def holding(module):
        return sum(p.grad is not None for p in module.parameters())

    def critic_backward(models, *args):
        seen.append(("critic", holding(models.actor)))
        return real_critic_backward(models, *args)

    def actor_backward(models, *args):
        seen.append(("actor", holding(models.critic_engine.module)))
        return real_actor_backward(models, *args)

    monkeypatch.setattr(ppo, "_critic_backward", critic_backward)
    monkeypatch.setattr(ppo, "_actor_backward", actor_backward)
    # and in the low-memory mode, after each network's step, the heap's freed pages go back to the OS
    monkeypatch.setattr(ppo.rss, "return_freed_memory", lambda: seen.append(("trim", 0)))
    # one mini-batch of 4 episodes of about 40 tokens, in micro-batches of at most 64: several a network
    ppo.run(tiny_config(tiny_model_dir, tmp_path / "run", "ppo.steps=1", "ppo.zero_stage=0",
                        "ppo.mini_batch=4", "ppo.micro_batch_tokens=64", "ppo.share_prefix=false",
                        f"ppo.gradient_checkpointing={str(low_memory).lower()}"))
    trim = [("trim", 0)] if low_memory else []
    micros = seen.count(("critic", 0))
    update = [("critic", 0)] * micros + trim + [("actor", 0)] * micros + trim
    start = next(i for i, event in enumerate(seen) if event[0] != "trim")
    assert micros >= 2 and seen[start:start + len(update)] == update
    # around the update: the heap's pages the rollouts freed, and those of the step, go back too
    assert set(seen[:start] + seen[start + len(update):]) == {("trim", 0)}


def test_the_update_starts_without_the_rollouts_kv_or_packed_weights(tiny_model_dir, tmp_path, monkeypatch):
    from stages.agent.backends.hf import HFBackend

    held, real_update, real_play = [], ppo.update, ppo.play_share
    backends = []

    def play_share(config, backend, *args):
        backends.append(backend)
        episodes = real_play(config, backend, *args)
        held.append(("rollouts", backend._prefix is not None, len(backend._linears._packed)))
        return episodes

    def update(*args, **kwargs):
        backend = backends[-1]
        held.append(("update", backend._prefix is not None or bool(backend._episodes), len(backend._linears._packed)))
        return real_update(*args, **kwargs)

    monkeypatch.setattr(ppo, "play_share", play_share)
    monkeypatch.setattr(ppo, "update", update)
    # and the heap pages the rollouts' forwards freed go back to the OS before it
    monkeypatch.setattr(ppo.rss, "return_freed_memory", lambda: held.append(("trim",)))
    ppo.run(tiny_config(tiny_model_dir, tmp_path / "run", "ppo.steps=1", "ppo.zero_stage=0", "rollout.max_turns=1",
                        "ppo.val_every=0"))
    assert isinstance(backends[0], HFBackend)
    rollouts = next(i for i, event in enumerate(held) if event[0] == "rollouts")
    (_, kv, packed), trim, after = held[rollouts:rollouts + 3]
    assert kv and packed > 0  # the rollouts cached the shared prefix's KV and packed the linear weights
    assert trim == ("trim",) and after == ("update", False, 0)


def test_scoring_in_the_update_makes_the_steps_of_separate_scoring_passes(answering_dir, tmp_path, monkeypatch):
    """One epoch over one mini-batch: the update's own forward passes give the values and the old
    log-probs (no pass before it), and two steps (the second with a trained critic) make the updates
    that separate no-grad passes make. The runs may compute the same numbers in other orders (a
    kernel with and without autograd), so a figure may move by the rounding of a float32 sum over a
    step's tokens, n x 2^-24 of it, per step; the weights' update by that share of its norm."""
    rows, weights, passes = {}, {}, []
    real_score = ppo.score
    monkeypatch.setattr(ppo, "score", lambda forward, micros, fields, *args, **kwargs: (
        passes.append((in_update, fields)), real_score(forward, micros, fields, *args, **kwargs)))
    for in_update in (True, False):
        out = tmp_path / f"in-update-{in_update}"
        ppo.run(load_config(None, [
            f"model.name={answering_dir}", f"ppo.out={out}", "quiet=true", "env.name=frozen_lake",
            "rollout.max_turns=1", "rollout.max_new_tokens=16", "rollout.groups=8", "rollout.group_size=2",
            "ppo.filter_ratio=0.5", "ppo.mini_batch=8", "ppo.steps=2", "ppo.actor_lr=1e-5", "ppo.critic_lr=1e-3",
            "ppo.val_every=0", "ppo.zero_stage=0", f"ppo.score_in_update={in_update}"]))
        rows[in_update] = read_metrics(out)
        weights[in_update] = load_file(out / "final" / "model.safetensors")
    for step, (fused, separate) in enumerate(zip(rows[True], rows[False], strict=True), start=1):
        assert fused["ppo_kl"] == 0.0 and fused["clip_frac"] == 0.0  # the old log-probs ARE this forward's
        assert fused["kept_seeds"] == separate["kept_seeds"] and fused["reward"] == separate["reward"]
        tolerance = step * fused["kept_episodes"] * fused["sequence_length"] * 2.0**-24
        for field in ("pg_loss", "value_loss", "entropy", "actor_grad_norm", "critic_grad_norm", "logp_diff",
                      "value_mean", "explained_variance"):
            if separate[field] is None:  # no spread of returns to explain
                assert fused[field] is None, (step, field)
                continue
            scale = 1.0 if field in ("pg_loss", "logp_diff") else abs(separate[field])  # means of differences
            assert abs(fused[field] - separate[field]) <= tolerance * scale, (step, field, fused[field], separate[field])
    assert passes == [(False, ("old_logprobs",)), (False, ("values",))] * 2  # none when the update scores
    assert rows[False][0]["value_mean"] == 0.0 != rows[False][1]["value_mean"]  # step 2 scores a trained critic
    assert rows[False][0]["explained_variance"] is not None  # step 1 kept groups whose rewards differ
    assert_same_weights(weights[True], weights[False], load_file(answering_dir / "model.safetensors"), tolerance)


@pytest.mark.parametrize("advantage, zero_stage", [("grpo", 0), ("bilevel_gae", 2)])
def test_other_estimators_and_loss_mask_all_run(tiny_model_dir, tmp_path, advantage, zero_stage):
    """The critic-free and turn-level estimators (the latter with VAGEN's state reward and the
    per-episode loss weighting), SPA's released loss mask and the KL term, on DeepSpeed and on the
    plain torch engine."""
    out = tmp_path / "run"
    vagen = ["ppo.state_reward=cells", "ppo.prompt_mode=world_model"] if advantage == "bilevel_gae" else []
    vagen += ["ppo.loss_agg=seq-mean-token-mean"] if vagen else []  # as SPA's runs weigh episodes
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.steps=1", f"ppo.advantage={advantage}", "ppo.loss_mask=all",
                        "ppo.kl_coef=0.1", f"ppo.zero_stage={zero_stage}", *vagen))
    row = read_metrics(out)[0]
    assert ("state_reward" in row) == bool(vagen)  # VAGEN's reward, when paid, is logged
    if vagen:
        assert row["state_reward"] == pytest.approx(row["state_reward_observation"] + row["state_reward_prediction"])
    assert math.isfinite(row["pg_loss"]) and math.isfinite(row["kl_ref"])
    assert row["logp_diff"] < 1e-3
    assert ("value_loss" in row) == (advantage != "grpo")
    assert (out / "trainer_state" / "critic").exists() == (advantage != "grpo")


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_bfloat16_on_the_cpu_samples_and_trains_in_bf16_over_fp32_weights(tiny_model_dir, tmp_path, zero_stage):
    config = tiny_config(tiny_model_dir, tmp_path / "run", "ppo.steps=1", f"ppo.zero_stage={zero_stage}",
                         "model.dtype=bfloat16")
    models = ppo.build_models(config)
    assert next(models.actor.parameters()).dtype == torch.float32
    probe = torch.tensor([[1, 2, 3]])
    assert models.actor(input_ids=probe).logits.dtype == torch.float32
    with ppo._autocast(models.actor_engine):  # what the reference (and the update) run under
        assert models.actor(input_ids=probe).logits.dtype == torch.bfloat16
    # the hf backend plays on a bf16 copy that every weight push refreshes from the fp32 actor
    assert models.generator is not models.actor
    assert {p.dtype for p in models.generator.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        for param in models.actor.parameters():
            param.add_(torch.randn_like(param))  # what an update does to the weights
    reset = []
    ppo.push_weights(models, types.SimpleNamespace(reset=lambda: reset.append(True)), config)
    pushed = dict(models.generator.named_parameters())
    for name, param in models.actor.named_parameters():
        assert torch.equal(pushed[name], param.detach().to(torch.bfloat16)), name
    assert reset == [True]  # the caches of the old weights are dropped
    ppo.run(config)
    row = read_metrics(tmp_path / "run")[0]
    assert 0 < row["logp_diff"] < 2e-2  # sampler and trainer both in bf16, in different batch shapes


def test_validation_measures_the_state_perplexity_of_the_live_actor(tiny_model_dir, tmp_path, tokenizer):
    """ppo.val_every with eval.state_ppl: the perplexity is the trained actor's, not the checkpoint's."""
    from transformers import AutoModelForCausalLM

    from stages.evaluation.perplexity import state_perplexity

    out = tmp_path / "run"
    config = tiny_config(tiny_model_dir, out, "ppo.steps=1", "ppo.val_every=1", "ppo.actor_lr=1e-2", "ppo.zero_stage=0",
                         "eval.seeds=2", "eval.pass_k=1", "eval.state_ppl=true")
    ppo.run(config)
    found = json.loads((out / "val" / "step-1.json").read_text())["metrics"]["state_perplexity"]["coords"]["ppl"]

    def ppl(model_dir):
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        return state_perplexity(model, tokenizer, config.env, [123, 124], prompt_mode="base")["coords"]["ppl"]

    assert found == pytest.approx(ppl(out / "final"), rel=1e-4)
    assert abs(found - ppl(tiny_model_dir)) > 1e-3 * found  # the update moved it
