"""The first user message each stage sends, under each prompt and render mode, character for
character: self-play data with the world-model prompt, PPO and eval with the base prompt (the
paper's App. A variant, or SPA's released one), on coordinate states or on the raw grid."""

from __future__ import annotations

import json

import pytest

import envs
from stages import evaluate, generate, ppo
from stages.common.config import load_config
from stages.evaluation.reports import trajectories_path

HEAD = "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets "
RULES = ("When you are exactly next to a box, you can push it by moving in the same direction. You cannot push a "
         "box through a wall, and you cannot pull a box. The answer should be a sequence of actions, like "
         "<answer>Right || Right || Up</answer>.")
COORDINATES = ("You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and "
               "each target. Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). ")
GRID = "You are provided with a symbol grid. "
SAMPLE = (" A sample full output is as follows: <think> <observation>######\n#_####\n#_P###\n#_X#_#\n#__O_#\n"
          "######{coordinates}</observation> {steps} <prediction>######\n#_####\n#__###\n#__#_#\n#PXO_#\n######"
          "</prediction> </think> <answer> Down || Left || Down </answer>")
STEPS = ("1 Down – I push box to (4,2). 2 Left – I step to (3,1). 3 Down – I stand left of box, ready to push it "
         "Right onto target.")
STEPS_WITHOUT_COORDINATES = ("1 Down – I push box down. 2 Left – I step left. 3 Down – I stand left of box, ready to "
                             "push it Right onto target.")
INSTRUCTIONS = {
    "world_model, coords": HEAD + COORDINATES + RULES + SAMPLE.format(
        coordinates="\nPlayer (P) is at (2,2); box (X) is at (3,2); target (O) is at (4,3).", steps=STEPS),
    "world_model, text": HEAD + GRID + RULES + SAMPLE.format(coordinates="", steps=STEPS_WITHOUT_COORDINATES),
    "base, coords (paper)": HEAD + COORDINATES + RULES,
    "base, coords (released)": HEAD + GRID + RULES,
    "base, text": HEAD + GRID + RULES,
}
FORMATS = {
    "world_model": ("<think> <observation> [current state] </observation> [Your thoughts] <prediction> "
                    "[next state]</prediction> </think> <answer> [your answer] </answer>"),
    "base": "<think> [Your thoughts] </think> <answer> [your answer] </answer>",
}
LEGEND_AND_ACTIONS = (
    "\nThe meaning of each symbol in the state is:\n#: wall, _: empty, O: target, √: box on target, X: box, "
    "P: player, S: player on target\nYour available actions are:\nUp, Down, Left, Right\nYou can make up to 10 "
    'actions, separated by the action separator " || "\n'
)


def first_message(instruction: str, prompt_mode: str, render_mode: str, seed: int) -> str:
    state = envs.make("sokoban", render_mode=render_mode).reset(seed=seed)[0]
    return (f"{INSTRUCTIONS[instruction]}{LEGEND_AND_ACTIONS}\nTurn 1:\nState:\n{state}\nYou have 10 actions "
            f"left. Always output: {FORMATS[prompt_mode]} with no extra text. Strictly follow this format. Max "
            "response length: 100 words (tokens).\n")


def test_the_states_differ_as_the_render_modes_say():
    coords, text = (envs.make("sokoban", render_mode=mode).reset(seed=123)[0] for mode in ("coords", "text"))
    assert coords.startswith(text + "\nPlayer (P) is at (") and "(" not in text


@pytest.mark.parametrize(("sets", "instruction", "prompt_mode", "render_mode"), [
    ([], "world_model, coords", "world_model", "coords"),  # the paper's self-play data
    (["generate.render_mode=text"], "world_model, text", "world_model", "text"),  # SPA w/o State Estimation
])
def test_generate(tmp_path, sets, instruction, prompt_mode, render_mode):
    out = tmp_path / "t.jsonl"
    generate.run(load_config(None, [f"generate.out={out}", "rollout.backend=random", "rollout.groups=1",
                                    "rollout.group_size=1", "quiet=true", *sets]))
    row = json.loads(out.read_text().splitlines()[0])
    assert (row["prompt_mode"], row["render_mode"]) == (prompt_mode, render_mode)
    assert row["messages"][1]["content"] == first_message(instruction, prompt_mode, render_mode, 10000)


@pytest.mark.parametrize(("sets", "instruction", "prompt_mode", "render_mode"), [
    ([], "base, coords (paper)", "base", "coords"),  # State Estimation, and SPA's eval
    (["env.options.base_instruction=released"], "base, coords (released)", "base", "coords"),
    (["eval.render_mode=text"], "base, text", "base", "text"),  # the base model, Vanilla RL
    (["eval.prompt_mode=world_model"], "world_model, coords", "world_model", "coords"),  # VAGEN
])
def test_eval(tmp_path, sets, instruction, prompt_mode, render_mode):
    out = tmp_path / "report.json"
    report = evaluate.run(load_config(None, [f"eval.out={out}", "rollout.backend=random", "eval.seeds=1",
                                             "eval.pass_k=1", "quiet=true", *sets]))
    assert (report["settings"]["prompt_mode"], report["settings"]["render_mode"]) == (prompt_mode, render_mode)
    row = json.loads(trajectories_path(out).read_text().splitlines()[0])
    assert row["messages"][1]["content"] == first_message(instruction, prompt_mode, render_mode, 123)


@pytest.mark.parametrize(("sets", "instruction", "prompt_mode", "render_mode"), [
    ([], "base, coords (paper)", "base", "coords"),  # State Estimation RL and SPA's RL
    (["ppo.render_mode=text", "ppo.val_every=1", "eval.render_mode=text"], "base, text", "base", "text"),
])
def test_ppo(tmp_path, tiny_model_dir, monkeypatch, sets, instruction, prompt_mode, render_mode):
    played = []
    real_play = ppo.play

    def recording_play(*args, **kwargs):
        episodes = real_play(*args, **kwargs)
        played.append(episodes)
        return episodes

    monkeypatch.setattr(ppo, "play", recording_play)
    out = tmp_path / "ppo"
    ppo.run(load_config(None, [
        f"model.name={tiny_model_dir}", f"ppo.out={out}", "quiet=true", "rollout.groups=2", "rollout.group_size=2",
        "rollout.max_turns=1", "rollout.max_new_tokens=4", "ppo.steps=1", "ppo.filter_ratio=1.0", "ppo.mini_batch=2",
        "ppo.zero_stage=0", "ppo.val_every=0", "eval.seeds=1", "eval.pass_k=1", *sets]))
    [episodes] = played  # the training rollouts of the one step
    assert {(e.prompt_mode, e.render_mode) for e in episodes} == {(prompt_mode, render_mode)}
    assert episodes[0].messages[1]["content"] == first_message(instruction, prompt_mode, render_mode, 10000)
    validations = sorted((out / "val").glob("step-*.trajectories.jsonl"))
    for path in validations:  # validation plays the eval section's modes
        row = json.loads(path.read_text().splitlines()[0])
        assert row["messages"][1]["content"] == first_message("base, text", "base", "text", 123)
    assert len(validations) == (2 if "ppo.val_every=1" in sets else 0)
