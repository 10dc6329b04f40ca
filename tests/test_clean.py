"""`spa clean`: exact ground-truth replacement, filters and their counts, split, row units."""

from __future__ import annotations

import json
import re

import pytest

from stages import clean
from stages.agent.parsing import parse_response, replace_states, well_formed
from stages.common import artifacts
from stages.common.config import SPAConfig
from stages.common.errors import UserError

S0 = "######\n#P_X_#\n######\nPlayer (P) is at (1,1); box (X) is at (1,3)."
S1 = "######\n#_PX_#\n######\nPlayer (P) is at (1,2); box (X) is at (1,3)."
S2 = "######\n#__PX#\n######\nPlayer (P) is at (1,3); box (X) is at (1,4)."
S3 = "######\n#___S#\n######\nPlayer (P) is at (1,4)."


def wm(obs: str, thoughts: str, pred: str, answer: str) -> str:
    return (f"<think> <observation>{obs}</observation> {thoughts} <prediction>{pred}</prediction> </think> "
            f"<answer>{answer}</answer>")


def trajectory(tid: str, turns: list[tuple[str, str, str]], success: bool = False, mode: str = "world_model",
               seed: int = 1) -> dict:
    """A trajectory line: turns are (state, response, next_state); messages follow the rollout layout,
    and each turn's `format_ok` is what the rollout's parser says of its response."""
    messages = [{"role": "system", "content": "You're a helpful assistant. "},
                {"role": "user", "content": f"Instruction\nTurn 1:\nState:\n{turns[0][0]}\n"}]
    for k, (_, response, next_state) in enumerate(turns):
        messages.append({"role": "assistant", "content": response})
        if k + 1 < len(turns):
            user = f"Reward:\n-0.1\n\nTurn {k + 2}:\nState:\n{next_state}\n"
            messages.append({"role": "user", "content": user})
    return {
        "id": tid, "env": "sokoban", "seed": seed, "group": 0, "sample": 0, "prompt_mode": mode, "model": "m",
        "turns": [{"state": s, "response": r, "next_state": n,
                   "format_ok": parse_response(r.removeprefix("<think>"), mode).format_ok} for s, r, n in turns],
        "messages": messages, "success": success, "total_reward": 0.0, "format_penalty": 0.0,
    }


# A: a two-action turn, a turn with no valid action (several observation tags), a turn that ends
# the episode mid-turn (upper-case tags).
A_RESPONSES = [
    wm("wrong grid", "I push right twice.", "a guess", "Right || Right"),
    ("<think> <observation>x</observation> hmm <observation>y</observation> <prediction>z</prediction> "
     "</think> <answer>Jump</answer>"),
    ("<think> <Observation>o</Observation> last push <PREDICTION>p</PREDICTION> </think> "
     "<answer>Right || Left</answer>"),
]
A = trajectory("sokoban-1-0", [(S0, A_RESPONSES[0], S2), (S2, A_RESPONSES[1], S2), (S2, A_RESPONSES[2], S3)],
               success=True)
A_CLEAN = [
    wm(S0, "I push right twice.", S2, "Right || Right"),
    (f"<think> <observation>{S2}</observation> hmm <observation>{S2}</observation> "
     f"<prediction>{S2}</prediction> </think> <answer>Jump</answer>"),
    (f"<think> <Observation>{S2}</Observation> last push <PREDICTION>{S3}</PREDICTION> </think> "
     "<answer>Right || Left</answer>"),
]
# B: malformed first turn (no answer), well-formed second turn.
B = trajectory("sokoban-1-1", [(S0, "<think> I go right", S0), (S0, wm("?", "right", "?", "Right"), S1)])
# C: nothing well-formed.
C = trajectory("sokoban-2-0", [(S0, "Right", S0)], seed=2)
# D: the same chat as A under another id.
D = {**A, "id": "sokoban-1-2"}
# E: a line whose messages and turns disagree.
E = {**trajectory("sokoban-3-0", [(S0, wm("a", "b", "c", "Up"), S1)], seed=3), "turns": []}


def config_for(tmp_path, trajectories: list[dict], **options) -> SPAConfig:
    config = SPAConfig()
    data = tmp_path / "trajectories.jsonl"
    artifacts.write_jsonl(data, trajectories)
    config.clean.data, config.clean.out = str(data), str(tmp_path / "sft.jsonl")
    config.clean.val_fraction = 0.0
    for key, value in options.items():
        setattr(config.clean, key, value)
    return config


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def assistant(row: dict) -> list[tuple[str, bool]]:
    return [(m["content"], m["train"]) for m in row["messages"] if m["role"] == "assistant"]


def test_ground_truth_replacement_is_exact():
    messages = clean.substitute_states(A)
    assert [m["content"] for m in messages if m["role"] == "assistant"] == A_CLEAN
    # user messages and the system prompt are untouched
    def others(chat):
        return [m for m in chat if m["role"] != "assistant"]
    assert others(messages) == others(A["messages"])
    # no valid action: the prediction is the observation
    assert A_CLEAN[1].count(S2) == 3
    # self-belief keeps the model's own states
    assert clean.substitute_states(A, "self_belief") == A["messages"]


def test_replacement_text_is_literal():
    state = r"a\1b \g<0> $"  # would be expanded by a replacement *string*
    assert replace_states("<observation>x</observation><prediction>y</prediction>", state, "n") == (
        f"<observation>{state}</observation><prediction>n</prediction>")


def test_trajectory_rows_and_counts(tmp_path):
    config = config_for(tmp_path, [A, B, C, D, E])
    summary = clean.run(config)
    rows = read_rows(config.clean.out)
    assert [row["id"] for row in rows] == ["sokoban-1-0", "sokoban-1-1"]
    assert rows[0] == {"id": "sokoban-1-0", "source_id": "sokoban-1-0", "env": "sokoban", "seed": 1,
                       "success": True, "messages": [
                           *A["messages"][:2], {"role": "assistant", "content": A_CLEAN[0], "train": True},
                           A["messages"][3], {"role": "assistant", "content": A_CLEAN[1], "train": True},
                           A["messages"][5], {"role": "assistant", "content": A_CLEAN[2], "train": True}]}
    # B's malformed first turn stays as context without loss
    assert assistant(rows[1]) == [("<think> I go right", False), (wm(S0, "right", S1, "Right"), True)]
    assert summary["dropped_trajectories"] == {"malformed": 1, "not_success": 0, "bad_line": 0}
    assert summary["dropped_rows"] == {"format": 1, "duplicate": 1}
    assert summary["untrained_turns"] == 1
    assert (summary["rows"], summary["train_rows"], summary["val_rows"]) == (2, 2, 0)
    assert read_rows(artifacts.val_path(config.clean.out)) == []
    manifest = json.loads((tmp_path / "sft.jsonl.manifest.json").read_text())
    assert manifest["stage"] == "clean" and manifest["summary"] == summary
    assert manifest["inputs"]["data"]["sha256"] == artifacts.file_sha256(config.clean.data)


def test_turn_rows(tmp_path):
    config = config_for(tmp_path, [A, B, C, D, E], unit="turn")
    summary = clean.run(config)
    rows = read_rows(config.clean.out)
    assert [row["id"] for row in rows] == ["sokoban-1-0-turn1", "sokoban-1-0-turn2", "sokoban-1-0-turn3",
                                           "sokoban-1-1-turn2"]
    assert {row["source_id"] for row in rows} == {"sokoban-1-0", "sokoban-1-1"}
    # turn 2: the prior chat (with true states) as context, only turn 2 trained, nothing after it
    assert rows[1]["messages"] == [*A["messages"][:2],
                                   {"role": "assistant", "content": A_CLEAN[0], "train": False},
                                   A["messages"][3],
                                   {"role": "assistant", "content": A_CLEAN[1], "train": True}]
    assert assistant(rows[3]) == [("<think> I go right", False), (wm(S0, "right", S1, "Right"), True)]
    assert summary["dropped_rows"] == {"format": 2, "duplicate": 3}  # B turn 1 and C; D's three turns
    assert summary["untrained_turns"] == 0


def test_filters(tmp_path):
    summary = clean.run(config_for(tmp_path, [A, B, C, D, E], success_only=True))
    assert summary["dropped_trajectories"]["not_success"] == 2 and summary["rows"] == 1
    # without the format filter every turn trains and C is kept; without dedup D is kept
    summary = clean.run(config_for(tmp_path, [A, B, C, D], filter_format=False, dedup=False))
    rows = read_rows(tmp_path / "sft.jsonl")
    assert [row["id"] for row in rows] == ["sokoban-1-0", "sokoban-1-1", "sokoban-2-0", "sokoban-1-2"]
    assert all(train for row in rows for _, train in assistant(row))
    assert summary["dropped_rows"] == {"format": 0, "duplicate": 0}


def test_the_format_filter_keeps_only_turns_whose_answer_was_executed(tmp_path):
    """Text between </prediction> and </think> passes SPA's tag check but not the rollout's parser:
    the answer never ran, so the state did not change, and the ground-truth replacement would teach
    "prediction = observation" under an answer that moves. The filter drops the turn."""
    chatty = ("<think> <observation>o</observation> I push right. <prediction>p</prediction> I am sure. "
              "</think> <answer>Right</answer>")
    assert parse_response(chatty.removeprefix("<think>")).format_ok is False
    assert well_formed(chatty)  # what SPA's filter_sft_by_tag.py alone would keep
    episode = trajectory("sokoban-5-0", [(S0, chatty, S0), (S0, wm("a", "right", "b", "Right"), S1)], seed=5)
    assert [turn["format_ok"] for turn in episode["turns"]] == [False, True]
    summary = clean.run(config_for(tmp_path, [episode], unit="turn"))
    [row] = read_rows(tmp_path / "sft.jsonl")
    assert row["id"] == "sokoban-5-0-turn2" and summary["dropped_rows"]["format"] == 1
    # in trajectory rows it stays as context, untrained
    clean.run(config_for(tmp_path, [episode]))
    [row] = read_rows(tmp_path / "sft.jsonl")
    assert [train for _, train in assistant(row)] == [False, True]
    # without the filter it trains, and teaches the prediction "nothing moved" under "Right"
    clean.run(config_for(tmp_path, [episode], filter_format=False))
    [row] = read_rows(tmp_path / "sft.jsonl")
    first, trained = assistant(row)[0]
    assert trained and first == chatty.replace(">o<", f">{S0}<").replace(">p<", f">{S0}<")


def test_base_mode_format_filter(tmp_path):
    base = trajectory("sokoban-4-0", [(S0, "<think> go </think> <answer>Up</answer>", S1)], mode="base")
    summary = clean.run(config_for(tmp_path, [base]))
    assert summary["rows"] == 1


def test_split_is_by_trajectory(tmp_path):
    many = [trajectory(f"sokoban-{i}-0", [(S0, wm("a", f"t{i}", "b", "Up"), S1),
                                          (S1, wm("c", "u", "d", "Up"), S2)], seed=i)
            for i in range(10)]
    config = config_for(tmp_path, many, unit="turn", val_fraction=0.3)
    summary = clean.run(config)
    train, val = read_rows(config.clean.out), read_rows(artifacts.val_path(config.clean.out))
    assert (summary["train_rows"], summary["val_rows"]) == (len(train), len(val)) == (14, 6)
    train_sources, val_sources = {r["source_id"] for r in train}, {r["source_id"] for r in val}
    assert len(val_sources) == 3 and not train_sources & val_sources
    # seeded: the same seed gives the same split, another seed (here) another one
    clean.run(config)
    assert {r["source_id"] for r in read_rows(artifacts.val_path(config.clean.out))} == val_sources
    config.clean.seed = 7
    clean.run(config)
    assert {r["source_id"] for r in read_rows(artifacts.val_path(config.clean.out))} != val_sources


def test_random_coordinates(tmp_path):
    config = config_for(tmp_path, [A], random_coordinates=True, seed=3)
    clean.run(config)
    first = read_rows(config.clean.out)[0]
    contents = [content for content, _ in assistant(first)]
    def inner(tag: str, content: str) -> str:
        return re.search(f"<{tag}>(.*?)</{tag}>", content, re.DOTALL | re.IGNORECASE).group(1)
    observations = [inner("observation", c) for c in contents]
    predictions = [inner("prediction", c) for c in contents]
    truth = [S0, S2, S2]
    coordinate = re.compile(r"\((\d+),(\d+)\)")
    for got, true in zip(observations, truth):
        # same text once the numbers are masked, numbers within the input's range (1..4)
        assert coordinate.sub("(#,#)", got) == coordinate.sub("(#,#)", true)
        assert all(1 <= int(n) <= 4 for pair in coordinate.findall(got) for n in pair)
    assert observations != truth  # (fixed seed: at least one number moved)
    # one state, one rewrite: turn t's prediction is turn t+1's observation
    assert predictions[0] == observations[1] and predictions[1] == observations[2]
    # what the model is trained to write is randomised; the prompt (the game's own states) is not
    assert [m for m in first["messages"] if m["role"] != "assistant"] == [
        m for m in A["messages"] if m["role"] != "assistant"]
    clean.run(config)
    assert read_rows(config.clean.out)[0] == first  # seeded


def test_bad_lines_and_options(tmp_path):
    config = config_for(tmp_path, [A])
    with open(config.clean.data, "a", encoding="utf-8") as handle:
        handle.write("{not json\n")
    with pytest.raises(UserError, match=r"trajectories.jsonl:2: not valid JSON"):
        clean.run(config)
    config.clean.skip_bad = True
    assert clean.run(config)["dropped_trajectories"]["bad_line"] == 1
    config.clean.val_fraction = 1.0
    with pytest.raises(UserError, match="val_fraction"):
        clean.run(config)
    config.clean.val_fraction, config.clean.states, config.clean.random_coordinates = 0.0, "self_belief", True
    with pytest.raises(UserError, match="random_coordinates"):
        clean.run(config)
    config.clean.random_coordinates, config.clean.out = False, str(tmp_path)
    with pytest.raises(UserError, match="is a directory"):
        clean.run(config)
    config.clean.out = config.clean.data
    with pytest.raises(UserError, match="overwrite"):
        clean.run(config)
    config.clean.data = str(tmp_path / "missing.jsonl")
    with pytest.raises(UserError, match="does not exist"):
        clean.run(config)


def test_no_rows_kept_names_the_filter_that_dropped_everything(tmp_path, capsys):
    failed = {**A, "success": False}
    clean.run(config_for(tmp_path, [failed, {**failed, "id": "sokoban-1-9"}], success_only=True))
    assert capsys.readouterr().out.splitlines()[-1] == (
        "clean: warning: no rows kept; --success-only kept nothing: none of the 2 trajectories succeeded "
        "(drop --success-only, or generate more episodes)")
    clean.run(config_for(tmp_path, [C]))  # nothing well-formed
    assert capsys.readouterr().out.splitlines()[-1] == (
        "clean: warning: no rows kept; the format filter dropped every turn: a model that never writes the format "
        "gives no data (bootstrap with the random backend, or --set clean.filter_format=false)")
    clean.run(config_for(tmp_path, [A, C], success_only=True))  # A succeeded: rows kept, no warning
    assert "no rows kept" not in capsys.readouterr().out
    config = config_for(tmp_path, [])
    with open(config.clean.data, "w", encoding="utf-8") as handle:
        handle.write("{not json\n")
    config.clean.skip_bad = True
    clean.run(config)
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"clean: warning: no rows kept; every line of {config.clean.data} was unreadable and skipped (--skip-bad); "
        "check the file")


CHATTY = ("<think> <observation>o</observation> I push right. <prediction>p</prediction> I am sure. "
          "</think> <answer>Right</answer>")  # passes SPA's tag check, not the rollout's parser


def test_spa_recipe_sokoban_trains_every_turn_and_splits_rows(tmp_path):
    """SPA's Sokoban data is raw self-play: every turn a row, nothing dropped, duplicates kept, and
    ceil(20%) of the rows held out, turns of one episode on both sides allowed."""
    config = config_for(tmp_path, [A, B, C, D], unit="turn", recipe="spa")
    summary = clean.run(config)
    train, val = read_rows(config.clean.out), read_rows(artifacts.val_path(config.clean.out))
    assert summary["dropped_rows"] == {"format": 0, "duplicate": 0}
    assert (len(train), len(val)) == (7, 2)  # 3 + 2 + 1 + 3 turns; ceil(0.2 x 9) = 2
    every = [f"{t['id']}-turn{k + 1}" for t in (A, B, C, D) for k in range(len(t["turns"]))]
    assert sorted(r["id"] for r in train + val) == sorted(every)
    assert [r["id"] for r in train] == [i for i in every if i in {r["id"] for r in train}]  # rows keep their order
    assert all(r["messages"][-1]["train"] for r in train + val)
    assert next(r for r in train if r["id"] == "sokoban-2-0-turn1")["messages"][-1]["content"] == "Right"
    # seeded: the same seed the same rows held out, another seed (here) others
    clean.run(config)
    assert read_rows(artifacts.val_path(config.clean.out)) == val
    config.clean.seed = 3
    clean.run(config)
    assert read_rows(artifacts.val_path(config.clean.out)) != val
    # rows split, not episodes: over many seeds some episode has turns on both sides
    shared = False
    for seed in range(20):
        train, val = clean.split_rows([{"source_id": i // 3, "n": i} for i in range(30)], 0.2, seed)
        assert (len(train), len(val)) == (24, 6)
        shared |= bool({r["source_id"] for r in train} & {r["source_id"] for r in val})
    assert shared


def test_spa_recipe_filters_other_games_by_the_tag_check_alone(tmp_path):
    """FrozenLake and Sudoku data went through SPA's filter_sft_by_tag.py: the tag check (which keeps
    a turn the rollout could not parse, unlike the strict filter) and de-duplication."""
    def on_frozen_lake(t: dict) -> dict:
        return {**t, "env": "frozen_lake"}
    chatty = trajectory("fl-5-0", [(S0, CHATTY, S0), (S0, wm("a", "right", "b", "Right"), S1)], seed=5)
    games = [on_frozen_lake(t) for t in (A, B, C, D, chatty)]
    summary = clean.run(config_for(tmp_path, games, unit="turn", recipe="spa"))
    # A's 3 turns, B's second, chatty's 2; B's first and C dropped; D's 3 duplicates of A's
    assert summary["dropped_rows"] == {"format": 2, "duplicate": 3} and summary["rows"] == 6
    strict = clean.run(config_for(tmp_path, games, unit="turn"))
    assert strict["dropped_rows"] == {"format": 3, "duplicate": 3} and strict["rows"] == 5


def test_spa_recipe_needs_turn_rows(tmp_path):
    with pytest.raises(UserError, match="clean.recipe=spa makes SPA's rows, one per turn split by row; set "
                                        "clean.unit=turn"):
        clean.run(config_for(tmp_path, [A], recipe="spa"))
