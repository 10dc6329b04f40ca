"""`spa probe` with fake models whose answers are known: an oracle that writes the true next state
and a copier that writes the current one; figures checked exactly per kind of action."""

from __future__ import annotations

import json
import re

import pytest

from stages import probe
from stages.agent.backends.base import Completion
from stages.common.config import load_config
from stages.common.errors import UserError


class CharTokenizer:
    """One token per character; the chat template joins the messages' contents."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


class FakeBackend:
    name = "fake"

    def __init__(self, answer):
        self.tokenizer = CharTokenizer()
        self.answer = answer

    def generate(self, requests, params):
        texts = [self.answer(self.tokenizer.decode(r.prompt_ids)) + "</prediction> </think>" for r in requests]
        return [Completion(self.tokenizer.encode(t), t) for t in texts]

    def release(self, keys):
        pass

    def close(self):
        pass


def observation_of(context: str) -> str:
    return re.findall(r"<observation>(.*?)</observation>", context, re.DOTALL)[-1]


def copier_backend():
    return FakeBackend(observation_of)


def copier_likelihood(context, target):
    """-0.5 nats a character for the copy, -2 for anything else."""
    per_char = 0.5 if target == observation_of(context) + "</prediction>" else 2.0
    return per_char * len(target), len(target)


def config(tmp_path, env="sokoban"):
    return load_config(None, [], {"env.name": env, "quiet": True})


def test_copier_is_exact_on_walls_and_wrong_on_moves(tmp_path):
    out = tmp_path / "probe.json"
    report = probe.run(config(tmp_path), out, states=4, backend=copier_backend(), likelihood=copier_likelihood)
    effects = report["effects"]
    assert effects["wall"]["exact"] == 1.0 and effects["wall"]["copies"] == 1.0
    assert effects["wall"]["likelihood"] is None  # the true state is the copy
    assert effects["move"]["exact"] == 0.0 and effects["move"]["copies"] == 1.0
    ll = effects["move"]["likelihood"]
    assert ll["true_logprob_per_token"] == -2.0 and ll["copy_logprob_per_token"] == -0.5
    assert ll["true_more_likely"] == 0.0
    assert report["all"]["cases"] == 16 and sum(f["cases"] for f in effects.values()) == 16
    assert json.loads(out.read_text()) == report
    rows = [json.loads(line) for line in probe.cases_path(out).read_text().splitlines()]
    assert len(rows) == 16 and {r["action"] for r in rows} == {"Up", "Down", "Left", "Right"}
    assert probe.load_report(out)["settings"]["states"] == 4


def test_oracle_is_exact_everywhere(tmp_path):
    cfg = config(tmp_path)
    cases = probe.probe_cases(cfg, "coords", range(probe.PROBE_FIRST_SEED, probe.PROBE_FIRST_SEED + 4))
    truth = {probe._render(CharTokenizer(), c): c.truth for c in cases}
    report = probe.run(cfg, tmp_path / "p.json", states=4, backend=FakeBackend(truth.__getitem__),
                       likelihood=lambda context, target: (0.1 * len(target) if target[:-13] == truth[context]
                                                           else 3.0 * len(target), len(target)))
    assert report["all"]["exact"] == 1.0 and report["all"]["cells"] == 1.0
    moves = report["effects"]["move"]
    assert moves["copies"] == 0.0 and moves["likelihood"]["true_more_likely"] == 1.0


@pytest.mark.parametrize("env,states,message", [("countdown", 2, "countdown has no"), ("sokoban", 0, "at least 1 state")])
def test_bad_input_is_one_user_error(tmp_path, env, states, message):
    with pytest.raises(UserError, match=message):
        probe.run(config(tmp_path, env), tmp_path / "p.json", states=states, backend=copier_backend(),
                  likelihood=copier_likelihood)


@pytest.mark.parametrize("args,message", [
    (["--env", "nogame"], "nogame"),
    (["--env", "countdown"], "countdown has no"),
    (["--env", "sokoban", "--states", "0"], "at least 1 state"),
    (["--env", "sokoban", "--model-dir-missing"], "is not a built-in name"),
])
def test_cli_bad_input_is_one_line_and_exit_2_before_any_model_loads(tmp_path, monkeypatch, args, message):
    from typer.testing import CliRunner

    from spa_cli.main import app
    from stages.common import models

    def no_load(*_):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(models, "load_model", no_load)
    model = str(tmp_path / "no-such-model") if "--model-dir-missing" in args else "smollm2-135m"
    args = [a for a in args if a != "--model-dir-missing"]
    result = CliRunner().invoke(app, ["probe", model, *args, "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert not (tmp_path / "p.json").exists()
