"""PPO learns: on a one-turn game that its starting policy already wins sometimes, a few steps of
`spa ppo` raise the reward; the same run with the advantages' sign flipped, or without the
policy loss, does not. So the test fails whenever PPO stops moving the policy towards reward.

The starting policy is `helpers.answering_model`, a tiny Llama that continues "<think>" with
" go </think> <answer> Left </answer>" or the same with "Jump" about equally often; the game pays 1
for Left and 0 for Jump. Sampled at temperature 0.5 (at 1 it rarely closes the format), it wins
about a third of its episodes. Each run checks that premise on its first step, so a changed model
or prompt fails loudly instead of teaching nothing."""

import json
import random
from pathlib import Path
from typing import ClassVar

import pytest

from envs import TextGameEnv
from envs.registry import SPECS, EnvSpec
from stages import ppo
from stages.common.config import load_config
from stages.training import ppo_algos

STEPS = 8
#: 4 puzzles x 4 samples a step: a success rate is a mean of 16 Bernoulli draws.
EPISODES_A_STEP = 16


class LeftOrJump(TextGameEnv):
    """Answer Left (pays 1) or Jump (pays 0); one action, then the game ends."""

    name: ClassVar[str] = "left_or_jump"
    action_names: ClassVar[tuple[str, ...]] = ("Left", "Jump")
    metadata: ClassVar[dict] = {"render_modes": ["text"]}
    prompt_modes: ClassVar[tuple[str, ...]] = ("base",)
    instructions: ClassVar[dict[str, str]] = {"base": "Answer Left or Jump."}
    max_actions_per_traj: ClassVar[int] = 1

    def _reset(self, rng: random.Random) -> None:
        self.answer = None

    def _step(self, action: str) -> tuple[float, bool, bool, dict]:
        self.answer = self.parse_action(action)
        won = self.answer == "Left"
        return float(won), True, False, {"success": won, "action_is_valid": self.answer is not None,
                                         "action_is_effective": True}

    def render_grid(self) -> str:
        return "Left or Jump?"

    def coordinate_line(self) -> str:
        return ""


def learning_run(model_dir: Path, out: Path, monkeypatch, *extra: str) -> list[float]:
    """Success per step of a short PPO run on LeftOrJump from ``model_dir``."""
    monkeypatch.setitem(SPECS, "left_or_jump", EnvSpec("left_or_jump", "spa/LeftOrJump-v0",
                                                       f"{__name__}:LeftOrJump"))
    config = load_config(None, [
        f"model.name={model_dir}", f"ppo.out={out}", "quiet=true", "env.name=left_or_jump",
        "ppo.render_mode=text", "eval.render_mode=text", "rollout.max_turns=1", "rollout.max_new_tokens=12", "rollout.temperature=0.5",
        "rollout.sample_seed=1",
        "rollout.groups=4", "rollout.group_size=4", "ppo.filter_ratio=1.0", f"ppo.mini_batch={EPISODES_A_STEP}",
        f"ppo.steps={STEPS}", "ppo.actor_lr=1e-3", "ppo.critic_lr=1e-3", "ppo.val_every=0", "ppo.save_every=100",
        *extra,
    ])
    ppo.run(config)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    successes = [row["success"] for row in rows]
    # the premise: the starting policy (the first step's player) wins some episodes and loses most,
    # so there is a reward to learn
    assert 0 < successes[0] < 0.75, f"the starting policy won {successes[0]:.0%} of its {EPISODES_A_STEP} episodes"
    return successes


def rise(successes: list[float]) -> float:
    """The mean success of the last two steps minus that of the first two."""
    return (sum(successes[-2:]) - sum(successes[:2])) / 2


@pytest.mark.parametrize("advantage", ["gae", "grpo"])
def test_ppo_raises_the_reward_of_a_policy_that_already_wins_sometimes(answering_dir, tmp_path, monkeypatch,
                                                                        advantage):
    successes = learning_run(answering_dir, tmp_path / "run", monkeypatch, f"ppo.advantage={advantage}")
    # From about half the episodes won to nearly all: a rise of 0.3 over 32 episodes each side is
    # far outside the noise of a policy that stands still (the std of a mean of 32 draws is <= 0.09).
    assert rise(successes) > 0.3, successes
    assert successes[-1] >= 0.75, successes


def test_flipped_advantages_do_not_raise_the_reward(answering_dir, tmp_path, monkeypatch):
    """The same run with every advantage negated: PPO now climbs away from the reward."""
    compute = ppo.compute_advantages

    def flipped(samples, config):
        compute(samples, config)
        for sample in samples:
            sample.advantages = -sample.advantages

    monkeypatch.setattr(ppo, "compute_advantages", flipped)
    successes = learning_run(answering_dir, tmp_path / "run", monkeypatch)
    assert rise(successes) < 0.1, successes


def test_without_the_policy_loss_the_reward_does_not_rise(answering_dir, tmp_path, monkeypatch):
    """Only the critic and the entropy bonus train: nothing pulls the policy towards Left."""
    loss = ppo_algos.policy_loss

    def off(*args, **kwargs):
        pg_loss, stats = loss(*args, **kwargs)
        return pg_loss * 0.0, stats

    monkeypatch.setattr(ppo.algos, "policy_loss", off)
    successes = learning_run(answering_dir, tmp_path / "run", monkeypatch)
    assert rise(successes) < 0.3, successes
