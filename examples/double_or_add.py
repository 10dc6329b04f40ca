"""Reach the target number from 1 by doubling or adding one: a whole spa game in one file."""

import random
from typing import ClassVar

from envs import TextGameEnv


class DoubleOrAdd(TextGameEnv):
    name = "double_or_add"
    action_names = ("Double", "Add one")
    legend = None
    instructions: ClassVar[dict[str, str]] = {
        "base": "Start at 1 and reach the target exactly. Answer like <answer>Double || Add one</answer>.",
        "world_model": "Start at 1 and reach the target exactly. Describe the state in <observation> and "
        "the state after your actions in <prediction>. Answer like <answer>Double || Add one</answer>.",
    }
    max_actions_per_traj = 10

    def __init__(self, render_mode: str = "coords", max_target: int = 40):
        super().__init__(render_mode=render_mode)
        self.max_target = max_target
        self.value = self.target = 1

    def _reset(self, rng: random.Random) -> None:
        self.value, self.target = 1, rng.randint(5, self.max_target)

    def _step(self, action: str) -> tuple[float, bool, bool, dict]:
        name = self.parse_action(action)
        if name is not None:
            self.value = self.value * 2 if name == "Double" else self.value + 1
        solved, valid = self.value == self.target, name is not None
        info = {"success": solved, "action_is_valid": valid, "action_is_effective": valid}
        return float(solved), solved or self.value > self.target, False, info

    def render_grid(self) -> str:
        return f"Value: {self.value}; target: {self.target}"

    def coordinate_line(self) -> str:
        return f"{self.target - self.value} to go."
