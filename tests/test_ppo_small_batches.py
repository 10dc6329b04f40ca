"""PPO settings that make small batches count: the filter without flat groups (RAGEN's
``rollout_filter_include_zero``), GRPO without the std division (verl's ``norm_adv_by_std_in_grpo``),
critic warm-up (verl's ``trainer.critic_warmup``), and several optimizer steps per PPO step
(``ppo.mini_batch``, ``ppo.ppo_epochs``: verl's ``ppo_mini_batch_size``, ``ppo_epochs``)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_ppo import read_metrics, tiny_config

from stages import ppo
from stages.common.errors import UserError
from stages.training import ppo_algos as algos
from stages.training import ppo_samples

# ---- the filter without flat groups ----------------------------------------------------------------

#            group 0: flat      group 1: std .0433     group 2: flat, all solved   group 3: std .433
SCORES = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.1, 10.5, 10.5, 10.5, 10.5, 1.0, 0.0, 0.0, 0.0,
          # group 4: a tie with group 1   group 5: 0.1 + 0.2 against 0.3, unequal floats of one sum
          -0.1, 0.0, 0.0, 0.0, 0.1 + 0.2, 0.3, 0.3, 0.3]
GROUPS = [g for g in range(6) for _ in range(4)]


def episodes_of(kept_groups):
    return [i for i, group in enumerate(GROUPS) if group in kept_groups]


def test_without_zero_the_filter_never_keeps_a_group_whose_rewards_do_not_vary():
    assert 0 < algos.group_spreads(SCORES, GROUPS)[5] <= algos.FLAT_SPREAD  # float rounding, not a spread
    # ratio 1: every group with a spread, none without
    assert algos.filter_groups(SCORES, GROUPS, 1.0, include_zero=False) == episodes_of({1, 3, 4})
    # 6 x 0.5 = 3 groups wanted, 3 vary: the same three
    assert algos.filter_groups(SCORES, GROUPS, 0.5, include_zero=False) == episodes_of({1, 3, 4})
    # 2 wanted: the largest spread, then of the tied groups 1 and 4 the first seen
    assert algos.filter_groups(SCORES, GROUPS, 2 / 6, include_zero=False) == episodes_of({1, 3})
    assert algos.filter_groups(SCORES, GROUPS, 1 / 6, include_zero=False) == episodes_of({3})
    # with zero (the default, SPA's): a ratio beyond the varied groups fills up with flat ones, group 5's
    # rounding first, then the first seen of the exact zeros
    assert algos.filter_groups(SCORES, GROUPS, 4 / 6) == episodes_of({1, 3, 4, 5})
    assert algos.filter_groups(SCORES, GROUPS, 5 / 6) == episodes_of({0, 1, 3, 4, 5})
    assert algos.filter_groups(SCORES, GROUPS, 1.0) == list(range(len(SCORES)))


def test_without_zero_a_batch_of_flat_groups_keeps_nothing():
    flat = [0.0, 0.0, -0.1, -0.1, 10.5, 10.5]
    assert algos.filter_groups(flat, [0, 0, 1, 1, 2, 2], 1.0, include_zero=False) == []
    assert algos.filter_groups(flat, [0, 0, 1, 1, 2, 2], 1.0) == [0, 1, 2, 3, 4, 5]


def test_a_rank_without_samples_in_a_short_mini_batch_makes_filler_passes():
    """Two ranks, a last mini-batch of one episode (the filter kept fewer than ppo.mini_batch): rank 1
    has nothing of it and repeats rank 0's micro-batch with weight 0, so both make the same passes."""
    samples = [ppo_samples.Sample(torch.zeros(n, dtype=torch.long), *([None] * 6), score=0.0, group=0)
               for n in (5, 3, 9)]
    shares = ppo_samples.rank_shares(samples, mini_batch=2, world=2)
    assert shares == [[[0], [1]], [[2], []]]
    parts = [[samples[i] for i in part] for part in shares[1]]
    assert ppo_samples.rank_micro_batches(parts, 100, rank=0) == [([[samples[2]]], 1.0)]
    assert ppo_samples.rank_micro_batches(parts, 100, rank=1) == [([[samples[2]]], 0.0)]


def flatten_scores(monkeypatch, spread_from_step):
    """Every episode of a step before `spread_from_step` scores 0 (no group varies); from it on, the
    first group's episodes score 0, 1, ... (one group varies). Returns the steps the update ran at."""
    real_play, real_update = ppo.play_share, ppo.update
    updated = []

    def play_share(config, backend, step, *args):
        episodes = real_play(config, backend, step, *args)
        for episode in episodes:
            varied = step >= spread_from_step and episode.group == 0
            episode.total_reward = float(episode.sample) if varied else 0.0
        return episodes

    def update(models, samples, shares, config, step, **kwargs):
        updated.append((step, len(samples), [len(mini[0]) for mini in shares]))
        return real_update(models, samples, shares, config, step, **kwargs)

    monkeypatch.setattr(ppo, "play_share", play_share)
    monkeypatch.setattr(ppo, "update", update)
    return updated


def test_a_step_where_no_group_varies_skips_its_update_and_says_so(tiny_model_dir, tmp_path, monkeypatch):
    """Step 1: both groups flat, nothing kept, no update, the weights as they were. Step 2: one group
    varies; its 2 episodes make one mini-batch of ppo.mini_batch=4, the rest of an empty one."""
    updated = flatten_scores(monkeypatch, spread_from_step=2)
    out = tmp_path / "run"
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.zero_stage=0", "rollout.max_turns=1", "ppo.mini_batch=4",
                        "ppo.filter_include_zero=false", "ppo.save_every=1"))
    skipped, trained = read_metrics(out)
    assert (skipped["flat_groups"], skipped["kept_groups"], skipped["kept_episodes"]) == (2, 0, 0)
    assert "pg_loss" not in skipped and "kept_reward" not in skipped and "seconds_update" not in skipped
    assert skipped["seed_counter"] == 2  # the step's puzzles were played all the same
    assert (trained["flat_groups"], trained["kept_groups"], trained["kept_episodes"]) == (1, 1, 2)
    assert trained["kept_reward"] == 0.5 and "pg_loss" in trained
    assert updated == [(2, 2, [2])]
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert same_weights(load_file(out / "step-1" / "model.safetensors"), initial)
    assert not same_weights(load_file(out / "final" / "model.safetensors"), initial)


def same_weights(weights: dict, others: dict) -> bool:
    assert weights.keys() == others.keys()
    return all(torch.equal(weights[name], others[name]) for name in weights)


def test_with_zero_flat_groups_are_trained_on_as_before(tiny_model_dir, tmp_path, monkeypatch):
    updated = flatten_scores(monkeypatch, spread_from_step=3)
    out = tmp_path / "run"
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.zero_stage=0", "rollout.max_turns=1", "ppo.steps=1"))
    [row] = read_metrics(out)
    assert (row["flat_groups"], row["kept_groups"], row["kept_episodes"]) == (2, 2, 4)
    assert updated == [(1, 4, [2, 2])]


# ---- GRPO without the std division ---------------------------------------------------------------

#: A group whose scores differ by the format penalty alone, and one where an episode solved the puzzle.
PENALTY_ONLY, ONE_SOLVED = [0.0, 0.0, 0.0, -0.1], [1.0, 0.0, 0.0, 0.0]


def grpo_advantages(norm_by_std):
    scores = torch.tensor(PENALTY_ONLY + ONE_SOLVED + [3.0], dtype=torch.float64)
    return algos.group_advantages(scores, torch.tensor([0] * 4 + [1] * 4 + [2]), norm_by_std=norm_by_std)


def test_grpo_without_the_std_centres_each_group_on_its_mean():
    # means -0.025 and 0.25; a group of one episode has no baseline: 0
    expected = torch.tensor([0.025, 0.025, 0.025, -0.075, 0.75, -0.25, -0.25, -0.25, 0.0], dtype=torch.float64)
    torch.testing.assert_close(grpo_advantages(norm_by_std=False), expected, rtol=0, atol=1e-15)


def test_grpo_with_the_std_gives_the_penalty_group_the_size_of_a_success():
    # unbiased stds 0.05 and 0.5, plus eps 1e-6: both groups are about (+-)0.5, 0.5, 0.5, 1.5
    expected = torch.tensor([0.025, 0.025, 0.025, -0.075] + [0.0] * 5, dtype=torch.float64) / (0.05 + 1e-6)
    expected[4:8] = torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64) / (0.5 + 1e-6)
    torch.testing.assert_close(grpo_advantages(norm_by_std=True), expected, rtol=0, atol=1e-12)
    assert expected[3] == pytest.approx(-1.5, abs=1e-4) and expected[4] == pytest.approx(1.5, abs=1e-4)


def test_the_setting_reaches_every_token_of_the_grpo_advantage():
    from stages.common.config import PPOConfig

    samples = [ppo_samples.Sample(torch.zeros(3, dtype=torch.long), torch.tensor(range(steps)), *([None] * 5),
                                  score=score, group=0) for steps, score in zip((2, 3, 1, 2), PENALTY_ONLY)]
    ppo_samples.compute_advantages(samples, PPOConfig(advantage="grpo", norm_adv_by_std_in_grpo=False))
    assert [s.advantages.tolist() for s in samples] == [[pytest.approx(a)] * s.steps
                                                        for s, a in zip(samples, (0.025, 0.025, 0.025, -0.075))]


def test_the_std_switch_is_refused_beside_a_critic(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match=r"ppo.norm_adv_by_std_in_grpo=false changes GRPO's advantage, and "
                                        r"ppo.advantage=gae whitens over the batch") as info:
        ppo.run(tiny_config(tiny_model_dir, tmp_path / "run", "ppo.norm_adv_by_std_in_grpo=false"))
    assert "\n" not in str(info.value)


# ---- several optimizer steps per PPO step ---------------------------------------------------------


def test_mini_batches_and_epochs_step_several_times_against_the_rollout_policys_log_probs(
        tiny_model_dir, tmp_path, monkeypatch):
    """4 kept episodes, ppo.mini_batch=2, ppo.ppo_epochs=2: 4 optimizer steps of each network, the
    critic's then the actor's on each mini-batch. Every policy loss reads the old log-probs that the
    pass before the first step wrote (the rollout policy's), bit for bit, while the actor it
    compares them with has moved away from them after the first step."""
    events, old, losses = [], {}, []
    real_score_samples, real_step, real_backward = ppo.score_samples, ppo._step, ppo._actor_backward
    real_loss = ppo.algos.policy_loss

    def score_samples(models, samples, *args, **kwargs):
        real_score_samples(models, samples, *args, **kwargs)
        old.update({id(s): s.old_logprobs.clone() for s in samples})
        events.append("scored")

    def step(engine, name, *args, **kwargs):
        events.append(name)
        return real_step(engine, name, *args, **kwargs)

    def actor_backward(models, batch, micro, *args):
        losses.append({"rollout": torch.cat([old[id(s)] for s in micro])})
        return real_backward(models, batch, micro, *args)

    def policy_loss(logprobs, old_logprobs, *args, **kwargs):
        losses[-1] |= {"old": old_logprobs.clone(), "new": logprobs.detach().clone()}
        return real_loss(logprobs, old_logprobs, *args, **kwargs)

    for name, wrapper in (("score_samples", score_samples), ("_step", step), ("_actor_backward", actor_backward)):
        monkeypatch.setattr(ppo, name, wrapper)
    monkeypatch.setattr(ppo.algos, "policy_loss", policy_loss)
    out = tmp_path / "run"
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.zero_stage=0", "rollout.max_turns=1", "ppo.steps=1",
                        "ppo.mini_batch=2", "ppo.ppo_epochs=2", "ppo.micro_batch_tokens=100000"))
    [row] = read_metrics(out)
    assert row["kept_episodes"] == 4 and row["actor_optimizer_steps"] == row["critic_optimizer_steps"] == 4
    assert events == ["scored"] + ["critic", "actor"] * 4
    assert len(losses) == 4  # one micro-batch a mini-batch
    for loss in losses:
        assert torch.equal(loss["old"], loss["rollout"])
    drift = [float((loss["new"] - loss["old"]).abs().max()) for loss in losses]
    # before the first step only the batch shapes differ (float rounding); after it the actor has moved
    assert drift[0] < min(drift[1:]), drift


# ---- critic warm-up ---------------------------------------------------------------------------------


def test_a_critic_warmup_step_moves_the_critic_and_leaves_the_actor_as_it_was(tiny_model_dir, tmp_path, monkeypatch):
    """ppo.critic_warmup=1 of 2 steps: step 1 scores values only and steps the critic alone, so its
    checkpoint is the starting actor bit for bit; step 2 trains both, with values the warm-up fitted."""
    passes = []
    real_score = ppo.score
    monkeypatch.setattr(ppo, "score", lambda forward, micros, fields, *args, **kwargs: (
        passes.append(fields), real_score(forward, micros, fields, *args, **kwargs)))
    out = tmp_path / "run"
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.zero_stage=0", "rollout.max_turns=1", "ppo.critic_warmup=1",
                        "ppo.kl_coef=0.1"))
    warmup, trained = read_metrics(out)
    assert (warmup["actor_optimizer_steps"], warmup["critic_optimizer_steps"]) == (0, 2)  # 4 episodes, mini_batch 2
    assert (trained["actor_optimizer_steps"], trained["critic_optimizer_steps"]) == (2, 2)
    for absent in ("pg_loss", "entropy", "kl_ref", "actor_grad_norm", "logp_diff", "seconds_old_logprobs"):
        assert absent not in warmup and absent in trained, absent
    assert warmup["value_loss"] > 0 and warmup["critic_grad_norm"] > 0
    assert warmup["value_mean"] == 0.0 != trained["value_mean"]  # the zero-initialised head learned in the warm-up
    # the warm-up's only pass is the critic's; then the actor's, the reference's and the critic's
    assert passes == [("values",), ("old_logprobs",), ("ref_logprobs",), ("values",)]
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert same_weights(load_file(out / "step-1" / "model.safetensors"), initial)
    assert not same_weights(load_file(out / "final" / "model.safetensors"), initial)


@pytest.mark.parametrize("overrides, message", [
    (["ppo.advantage=grpo"], (r"ppo.critic_warmup=1 trains the critic alone at first, and ppo.advantage=grpo "
                              r"has no critic; set ppo.critic_warmup=0")),
    (["ppo.critic=shared"], r"ppo.critic=shared trains its value head through the actor's own weights"),
    (["ppo.steps=1"], r"ppo.steps=1 leaves the actor no step; set ppo.critic_warmup below 1"),
])
def test_a_critic_warmup_without_a_critic_of_its_own_or_steps_after_it_is_refused(tiny_model_dir, tmp_path,
                                                                                   overrides, message):
    with pytest.raises(UserError, match=message) as info:
        ppo.run(tiny_config(tiny_model_dir, tmp_path / "run", "ppo.critic_warmup=1", *overrides))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()
