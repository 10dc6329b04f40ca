"""`spa generate` (resume, manifest, summary, errors) and generate -> clean end to end."""

from __future__ import annotations

import io
import json
import random
import re

import pytest

from stages import clean, generate
from stages.agent.backends.base import Completion
from stages.common import artifacts
from stages.common.config import SPAConfig, load_config
from stages.common.errors import UserError

THOUGHT = "I will push the box to the target."


class RandomActions:
    """A text-only policy: well-formed responses with random actions (the paper's RandSFT)."""

    name = "scripted"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.keys: list[str] = []

    def generate(self, requests, params, progress=None):
        self.keys += [r.key for r in requests]
        out = []
        for request in requests:
            actions = " || ".join(request.env.sample_action(self.rng) for _ in range(3))
            text = (f" <observation>?</observation> {THOUGHT} <prediction>?</prediction> </think> "
                    f"<answer>{actions}</answer>")
            out.append(Completion([], text))
        return out

    def release(self, keys):
        pass


def make_config(tmp_path, groups=2, group_size=2, **rollout) -> SPAConfig:
    config = SPAConfig()
    config.quiet = True
    config.env.name = "sokoban"
    config.generate.out = str(tmp_path / "trajectories.jsonl")
    config.clean.data, config.clean.out = config.generate.out, str(tmp_path / "sft.jsonl")
    config.rollout.groups, config.rollout.group_size = groups, group_size
    for key, value in rollout.items():
        setattr(config.rollout, key, value)
    return config


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_generate_writes_trajectories_and_resumes(tmp_path):
    config = make_config(tmp_path)
    backend = RandomActions()
    summary = generate.run(config, backend=backend)
    rows = read_rows(config.generate.out)
    # appended as they finish
    assert sorted(row["id"] for row in rows) == ["sokoban-10000-0", "sokoban-10000-1", "sokoban-10001-0",
                                           "sokoban-10001-1"]
    assert all(row["model"] == "smollm2-135m" and row["prompt_mode"] == "world_model" for row in rows)
    assert summary["episodes"] == summary["new_episodes"] == 4
    assert summary["format_ok_rate"] == 1.0
    assert summary["mean_turns"] == sum(len(row["turns"]) for row in rows) / 4
    assert summary["success_rate"] == sum(row["success"] for row in rows) / 4
    manifest = json.loads((tmp_path / "trajectories.jsonl.manifest.json").read_text())
    assert manifest["stage"] == "generate" and manifest["summary"] == summary
    assert manifest["config"]["rollout"]["groups"] == 2

    # an existing file needs --resume
    with pytest.raises(UserError, match=r"already holds a generate run; add --resume to continue it"):
        generate.run(config, backend=RandomActions())

    # resume: more groups play only the new seed; a torn last line is replayed
    with open(config.generate.out, "a", encoding="utf-8") as handle:
        handle.write('{"id": "sokoban-10002-0", "tur')
    config.rollout.groups, config.generate.resume = 3, True
    backend = RandomActions()
    summary = generate.run(config, backend=backend)
    assert set(backend.keys) == {"sokoban-10002-0", "sokoban-10002-1"}
    rows = read_rows(config.generate.out)
    assert len(rows) == 6 and len({row["id"] for row in rows}) == 6
    assert (summary["episodes"], summary["new_episodes"]) == (6, 2)

    # nothing left to do
    backend = RandomActions()
    generate.run(config, backend=backend)
    assert backend.keys == [] and len(read_rows(config.generate.out)) == 6


def test_resume_refuses_other_settings(tmp_path):
    config = make_config(tmp_path, groups=1, group_size=1)
    generate.run(config, backend=RandomActions())
    config.rollout.temperature, config.generate.resume = 0.5, True
    with pytest.raises(UserError, match=r"other settings \(rollout.temperature: 1.0 -> 0.5\); restore them to "
                                        r"continue it, or choose another --out to start fresh"):
        generate.run(config, backend=RandomActions())
    (tmp_path / "trajectories.jsonl.manifest.json").unlink()
    with pytest.raises(UserError, match="has no readable trajectories.jsonl.manifest.json"):
        generate.run(config, backend=RandomActions())


def test_out_must_be_a_file(tmp_path):
    config = make_config(tmp_path)
    config.generate.out = str(tmp_path)
    with pytest.raises(UserError, match="is a directory"):
        generate.run(config, backend=RandomActions())


@pytest.mark.parametrize("key", ["groups", "group_size", "max_turns", "max_new_tokens"])
def test_bad_counts_are_user_errors(key):
    with pytest.raises(UserError, match=f"rollout.{key} must be >= 1, got 0"):
        load_config(None, [f"rollout.{key}=0"])


def check_clean_rows(sft_rows: list[dict], trajectories: dict[str, dict]) -> None:
    """Every trained assistant message carries its turn's true states."""
    for row in sft_rows:
        source = trajectories[row["source_id"]]
        answers = [m for m in row["messages"] if m["role"] == "assistant"]
        for t, message in enumerate(answers):
            turn = source["turns"][t]
            assert f"<observation>{turn['state']}</observation>" in message["content"]
            assert f"<prediction>{turn['next_state']}</prediction>" in message["content"]
            assert THOUGHT in message["content"]


def test_generate_then_clean(tmp_path):
    config = make_config(tmp_path, groups=3, group_size=2)
    generate.run(config, backend=RandomActions())
    config.clean.val_fraction = 0.34
    summary = clean.run(config)
    trajectories = {row["id"]: row for row in read_rows(config.generate.out)}
    train, val = read_rows(config.clean.out), read_rows(artifacts.val_path(config.clean.out))
    assert summary["rows"] == len(train) + len(val) == 6 - summary["dropped_rows"]["duplicate"]
    assert len(val) == 2
    check_clean_rows(train + val, trajectories)
    # the last turn's prediction is the final state of the game
    for row in train + val:
        last = [m for m in row["messages"] if m["role"] == "assistant"][-1]["content"]
        assert trajectories[row["source_id"]]["turns"][-1]["next_state"] in last


def test_random_backend_generate_then_clean(tmp_path):
    config = make_config(tmp_path, groups=2, group_size=2, backend="random")
    summary = generate.run(config)
    rows = read_rows(config.generate.out)
    assert summary["episodes"] == len(rows) == 4 and all(row["model"] == "random" for row in rows)
    assert summary["format_ok_rate"] == 1.0  # the random backend always writes the format
    summary = clean.run(config)
    assert summary["rows"] >= 1
    check_rows = read_rows(config.clean.out) + read_rows(artifacts.val_path(config.clean.out))
    for row in check_rows:
        source = {r["id"]: r for r in rows}[row["source_id"]]
        answers = [m for m in row["messages"] if m["role"] == "assistant"]
        for t, message in enumerate(answers):
            assert f"<prediction>{source['turns'][t]['next_state']}</prediction>" in message["content"]


def test_clean_shows_a_share_of_the_trajectories_with_the_base_prompt(tmp_path):
    """The rewritten rows are what the base prompt shows: a base-mode game of the same seeds plays the
    same random actions (drawn per episode and turn), so its user messages must equal theirs."""
    config = make_config(tmp_path, groups=4, group_size=1, backend="random", max_turns=2, random_actions=[1, 1])
    config.clean.val_fraction, config.clean.base_prompt_fraction = 0.0, 0.5
    generate.run(config)
    clean.run(config)
    base = make_config(tmp_path / "base", groups=4, group_size=1, backend="random", max_turns=2,
                       random_actions=[1, 1])
    base.generate.prompt_mode = "base"
    generate.run(base)
    played_base = {row["id"]: row["messages"] for row in read_rows(base.generate.out)}
    played_world_model = {row["id"]: row for row in read_rows(config.generate.out)}
    rows = read_rows(config.clean.out)
    shown_base = [row for row in rows if "<think> [Your thoughts] </think>" in row["messages"][1]["content"]]
    assert len(rows) == 4 and len(shown_base) == 2
    for row in rows:
        source = played_world_model[row["source_id"]]
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        wanted = played_base[row["source_id"]] if row in shown_base else source["messages"]
        assert users == [m["content"] for m in wanted if m["role"] == "user"]
        for t, message in enumerate(m for m in row["messages"] if m["role"] == "assistant"):  # states kept
            assert f"<prediction>{source['turns'][t]['next_state']}</prediction>" in message["content"]
    config.env.options = {"dim": 7}  # another room size: another instruction, refused in one line
    with pytest.raises(UserError, match="does not start with the world-model instruction"):
        clean.run(config)


def test_hf_backend_generate_then_clean(tmp_path, tiny_model_dir, tokenizer):
    config = make_config(tmp_path, groups=2, group_size=2, backend="hf", max_new_tokens=6, max_turns=2)
    config.model.name = str(tiny_model_dir)
    config.model.device = "cpu"
    summary = generate.run(config)
    rows = read_rows(config.generate.out)
    assert summary["episodes"] == len(rows) == 4
    for row in rows:
        assert row["model"] == str(tiny_model_dir)
        # a random tiny model never writes the format: every turn is penalised and nothing runs
        assert [t["format_ok"] for t in row["turns"]] == [False, False]
        assert all(t["executed"] == [] and t["next_state"] == t["state"] for t in row["turns"])
        assert row["format_penalty"] == pytest.approx(-0.2) and row["total_reward"] == pytest.approx(-0.2)
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "user", "assistant"]
        assert all(m["content"].startswith("<think>") for m in row["messages"] if m["role"] == "assistant")
    summary = clean.run(config)
    assert summary["rows"] == 0 and summary["dropped_rows"]["format"] == 4
    config.clean.filter_format = False
    assert clean.run(config)["rows"] == 4


def test_hf_backend_token_bookkeeping(tmp_path, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from stages.agent.backends import make_backend
    from stages.agent.proxy import play

    config = make_config(tmp_path, backend="hf", max_new_tokens=6, max_turns=3)
    config.model.name, config.model.device = str(tiny_model_dir), "cpu"
    tok = tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    backend = make_backend(config.model, config.rollout, prompt_mode="world_model", model=model, tokenizer=tok)
    episodes = play(config.env, config.rollout, backend, [10000], 2, prompt_mode="world_model", render_mode="coords",
                    model=config.model.name)
    for episode in episodes:
        assert episode.single_sequence and len(episode.turn_spans) == len(episode.turns) == 3
        assert len(episode.response_mask) == len(episode.token_ids)
        assert all(0 < b - a <= 6 for a, b in episode.turn_spans)
        # the tokens between completions are the template's text around the next user message
        spans = episode.turn_spans
        gaps = [(0, spans[0][0])] + [(spans[k - 1][1], spans[k][0]) for k in range(1, len(spans))]
        users = [m["content"] for m in episode.messages if m["role"] == "user"]
        first = tok.apply_chat_template(episode.messages[:2], tokenize=False, add_generation_prompt=True)
        assert episode.token_ids[:spans[0][0]] == tok.encode(first + "<think>", add_special_tokens=False)
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        assert spans[-1][1] == len(episode.token_ids)
        for k in range(1, len(spans)):
            gap = tok.decode(episode.token_ids[gaps[k][0]:gaps[k][1]])
            between = f"\n<|im_start|>user\n{users[k]}<|im_end|>\n<|im_start|>assistant\n<think>"
            ended_with_marker = episode.token_ids[spans[k - 1][1] - 1] == im_end
            assert gap == (between if ended_with_marker else "<|im_end|>" + between)
        # the completions are the sampled tokens, and the messages hold their text
        answers = [m["content"] for m in episode.messages if m["role"] == "assistant"]
        for (a, b), answer in zip(spans, answers):
            assert answer == "<think>" + tok.decode(episode.token_ids[a:b], skip_special_tokens=True)
            assert all(episode.response_mask[a:b])
        assert sum(episode.response_mask) == sum(b - a for a, b in spans)
        # the sampler's log-probs on the sampled tokens, 0.0 elsewhere
        assert len(episode.logprobs) == len(episode.token_ids)
        assert all(lp <= 0 if sampled else lp == 0.0 for lp, sampled in zip(episode.logprobs, episode.response_mask))


def test_generate_says_what_it_will_do_then_counts_turns_and_tokens_before_an_episode_ends(
        tmp_path, tiny_model_dir, monkeypatch, capsys):
    from stages.common import console

    log = io.StringIO()  # a log file, not a terminal: plain progress lines
    monkeypatch.setattr(console.sys, "stderr", log)
    monkeypatch.setattr(console, "LOG_EVERY_S", 0.0)  # a line for every update
    config = make_config(tmp_path, groups=1, group_size=2, backend="hf", max_new_tokens=4, max_turns=3)
    config.quiet = False
    config.model.name, config.model.device = str(tiny_model_dir), "cpu"
    summary = generate.run(config)
    assert capsys.readouterr().out.splitlines()[0] == (
        f"generate: 2 episodes (1 group x 2) of up to 3 turns on sokoban; model {tiny_model_dir}, hf backend on "
        f"cpu (float32); -> {config.generate.out}")
    shown = [re.fullmatch(r"generate: (\d+)/6 turns \(\d+%\) episodes (\d+)/2 \(0 solved\)"
                          r"(?:, (\d+) tok \(\d+/s\))?; \d+s elapsed(, ETA \d+s)?", line)
             for line in log.getvalue().splitlines() if line.startswith("generate")]  # not the load's
    assert all(shown), log.getvalue()
    lines = [(int(turns), int(episodes), int(tokens or 0), bool(eta)) for turns, episodes, tokens, eta in
             (match.groups() for match in shown)]
    assert lines[0] == (0, 0, 0, False)  # at once, before the first token
    # a tiny random model never ends an episode early: both play their 3 turns, counted as they
    # come back, with the tokens of each decode step, before the first episode ends
    before_an_end = [line for line in lines if line[1] == 0]
    assert {turns for turns, *_ in before_an_end} == {0, 2, 4, 6}
    first_turn_tokens = [tokens for turns, _, tokens, _ in before_an_end if turns == 0]
    assert first_turn_tokens == sorted(set(first_turn_tokens)) and len(first_turn_tokens) >= 3
    assert all(eta == (episodes > 0) for _, episodes, _, eta in lines)  # an ETA once an episode has ended
    assert lines[-1] == (6, 2, summary["tokens"], True)
