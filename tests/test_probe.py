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


def per_pair(likelihood):
    """A batched `probe.Likelihood` from a function of one (context, target) pair."""
    return lambda pairs: [likelihood(context, target) for context, target in pairs]


@per_pair
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
    changing = sum(f["cases"] for name, f in effects.items() if name in ("move", "push"))
    assert report["changed"]["cases"] == changing and report["changed"]["exact"] == 0.0
    assert report["changed"]["copies"] == 1.0 and report["changed"]["likelihood"]["cases"] == changing
    assert json.loads(out.read_text()) == report
    rows = [json.loads(line) for line in probe.cases_path(out).read_text().splitlines()]
    assert len(rows) == 16 and {r["action"] for r in rows} == {"Up", "Down", "Left", "Right"}
    assert probe.load_report(out)["settings"]["states"] == 4
    assert report["settings"]["true_more_likely_by"] == "mean log-likelihood per token"


def test_oracle_is_exact_everywhere(tmp_path):
    cfg = config(tmp_path)
    cases = probe.probe_cases(cfg, "coords", range(probe.PROBE_FIRST_SEED, probe.PROBE_FIRST_SEED + 4))
    truth = {probe._render(CharTokenizer(), c): c.truth for c in cases}
    report = probe.run(cfg, tmp_path / "p.json", states=4, backend=FakeBackend(truth.__getitem__),
                       likelihood=per_pair(lambda context, target: (0.1 * len(target) if target[:-13] == truth[context]
                                                                    else 3.0 * len(target), len(target))))
    assert report["all"]["exact"] == 1.0 and report["all"]["cells"] == 1.0
    moves = report["effects"]["move"]
    assert moves["copies"] == 0.0 and moves["likelihood"]["true_more_likely"] == 1.0
    assert report["changed"]["exact"] == 1.0 and report["changed"]["likelihood"]["true_more_likely"] == 1.0


def test_the_true_state_is_more_likely_per_token_not_in_sum():
    """A true state of 4 tokens at -1.5 nats each against a copy of 2 tokens at -2.5: the copy's sum
    (-5) beats the true state's (-6), but per token the true state is the more likely text."""
    longer_true = {"true_nll": 6.0, "true_tokens": 4, "copy_nll": 5.0, "copy_tokens": 2}
    shorter_true = {"true_nll": 3.0, "true_tokens": 1, "copy_nll": 4.0, "copy_tokens": 2}  # sum: true; mean: copy
    rows = [{"exact": False, "cells": 0.0, "any_outcome": False, "copies": True, "likelihood": likelihood}
            for likelihood in (longer_true, shorter_true, longer_true)]
    figures = probe.summarize(rows)["likelihood"]
    assert figures["true_more_likely"] == pytest.approx(2 / 3)
    assert figures["true_logprob_per_token"] == pytest.approx(-15 / 9)
    assert figures["copy_logprob_per_token"] == pytest.approx(-14 / 6)


def test_the_decode_stops_where_a_prediction_can_no_longer_be_exact(tmp_path):
    """The token bound is the longest true state with its </prediction> plus the margin."""
    cfg = config(tmp_path)
    cases = probe.probe_cases(cfg, "coords", range(probe.PROBE_FIRST_SEED, probe.PROBE_FIRST_SEED + 2))
    backend = copier_backend()
    asked = []
    real_generate = backend.generate
    backend.generate = lambda requests, params: asked.append(params) or real_generate(requests, params)
    probe.run(cfg, tmp_path / "p.json", states=2, backend=backend, likelihood=copier_likelihood)
    longest = max(len(c.truth + "</prediction>") for c in cases)  # one token a character
    assert [(p.max_new_tokens, p.temperature, p.stop) for p in asked] == [
        (longest + probe.EXTRA_TOKENS, 0.0, ("</prediction>",))]


@pytest.mark.parametrize("forward_tokens", [probe.FORWARD_TOKENS, 30, 60])  # all rows, then one or two a forward
def test_the_batched_likelihood_equals_one_forward_per_pair(tokenizer, monkeypatch, forward_tokens):
    """Shared prefix, right padding and chunks change nothing: each pair's NLL equals a plain forward
    over its context and target (fp32; what differs is the rounding of sums of a few dozen
    log-probs of ~10 nats, far below 1e-4 relative)."""
    import torch
    from helpers import lively_model

    from stages.evaluation.perplexity import split_continuation, target_nll

    monkeypatch.setattr(probe, "FORWARD_TOKENS", forward_tokens)
    model = lively_model(tokenizer, seed=3)
    head = "<|im_start|>system\nYou push boxes.<|im_end|>\n<|im_start|>user\nThe board:\n"
    pairs = [(head + board + " I move " + move + ". <prediction>", state + "</prediction>")
             for board, state in (("#_P_#\n#_X_#", "#__P#\n#_X_#"), ("#P__#\n#OX_#", "#_P_#"))
             for move in ("Up", "Right")] + [(head + "#", "#_P_#</prediction>")]
    batched = probe.model_likelihood(model, tokenizer)(pairs)
    assert len(batched) == len(pairs)
    with torch.inference_mode():
        for (context, target), (value, tokens) in zip(pairs, batched):
            context_ids, target_ids = split_continuation(tokenizer, context, target)
            assert tokens == len(target_ids)
            assert value == pytest.approx(target_nll(model, context_ids, target_ids, "cpu"), rel=1e-4)


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


def test_eval_compare_puts_probe_reports_side_by_side(tmp_path):
    """A copier and an oracle: the copier scores nothing where the state changes, the oracle all."""
    from typer.testing import CliRunner

    from spa_cli.main import app

    cfg = config(tmp_path)
    cases = probe.probe_cases(cfg, "coords", range(probe.PROBE_FIRST_SEED, probe.PROBE_FIRST_SEED + 2))
    truth = {probe._render(CharTokenizer(), c): c.truth for c in cases}
    copier, oracle = tmp_path / "copier.json", tmp_path / "oracle.json"
    probe.run(cfg, copier, states=2, backend=copier_backend(), likelihood=copier_likelihood)
    probe.run(cfg, oracle, states=2, backend=FakeBackend(truth.__getitem__),
              likelihood=per_pair(lambda context, target: (0.1 if target[:-13] == truth[context] else 3.0, 1)))
    runner = CliRunner()
    result = runner.invoke(app, ["eval", "compare", str(copier), str(oracle), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    effects = list(json.loads(copier.read_text())["effects"])
    assert [(r["report"], r["cases"], r["changed_exact"], r["true_more_likely"]) for r in rows] == [
        (str(copier), 8, 0.0, 0.0), (str(oracle), 8, 1.0, 1.0)]
    assert list(rows[0]["exact"]) == [*effects, "all"] and rows[1]["exact"]["all"] == 1.0
    assert rows[0]["exact"].get("wall", 1.0) == 1.0 and rows[0]["exact"]["move"] == 0.0
    result = runner.invoke(app, ["eval", "compare", str(copier), str(oracle), "--format", "markdown"])
    lines = result.output.splitlines()
    assert lines[0] == "| report | model | cases | exact, changed % | cells, changed % | true > copy % | " + " | ".join(
        f"exact {effect} %" for effect in [*effects, "all"]) + " |"
    assert lines[3].startswith(f"| {oracle} | smollm2-135m | 8 | 100.0 | 100.0 | 100.0 |")
    result = runner.invoke(app, ["eval", "compare", str(copier), str(oracle)])
    assert result.exit_code == 0 and "exact, changed %" in result.output and str(oracle) in result.output
    other, eval_report = tmp_path / "other.json", tmp_path / "report.json"
    eval_report.write_text(json.dumps({"format": "spa-eval-report"}))
    probe.run(cfg, other, states=1, backend=copier_backend(), likelihood=copier_likelihood)
    for args, says in ((["eval", "compare", str(copier), str(other)], "probed with states=1"),
                       (["eval", "compare", str(copier), str(tmp_path / "missing.json")], "does not exist"),
                       (["eval", "compare", str(copier), str(probe.cases_path(copier))], "cannot read"),
                       (["eval", "compare", str(copier), str(eval_report)], "mix spa probe and spa eval"),
                       (["eval", "compare", str(copier), str(oracle), "--plot", "x.png"], "Pass@k curves")):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and says in result.output, result.output
    assert runner.invoke(app, ["eval", "compare", str(copier), str(other), "--force"]).exit_code == 0
