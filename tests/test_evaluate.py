"""`spa eval` end to end: a scripted policy with a known success pattern gives exactly the expected
report; reports carry their settings; compare, plot, state perplexity and bad input."""

import copy
import io
import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest

from envs.sokoban_solver import solve
from stages import evaluate
from stages.agent.backends.base import Completion
from stages.common.config import EnvConfig, load_config
from stages.common.errors import UserError
from stages.evaluation import plots, reports, runner, tables
from stages.evaluation.metrics import states_match
from stages.evaluation.perplexity import state_perplexity

FIRST_SEED = 123
# (seed -> the samples that solve it): 4 seeds x n=4 samples, 7 successes in all.
SOLVERS = {123: {0, 1, 2, 3}, 124: {1}, 125: set(), 126: {0, 2}}
N = 4


class ScriptedBackend:
    """Answers like a perfect world model that plays the optimal solution for the (seed, sample)
    pairs in `solvers`, and with unparseable text for the others.

    It reads the episode's seed and sample from the request key (``sokoban-<seed>-<sample>``) and
    plans on a copy of the live game, so the observation is the state shown and the prediction the
    state after its actions.
    """

    name = "scripted"

    def __init__(self, solvers, max_actions=5):
        self.solvers, self.max_actions = solvers, max_actions
        self.calls = 0

    def generate(self, requests, params, progress=None):
        self.calls += 1
        completions = []
        for request in requests:
            _, seed, sample = request.key.rsplit("-", 2)
            if int(sample) not in self.solvers.get(int(seed), ()):
                completions.append(Completion(token_ids=[], text=" I am not sure. </think> nothing"))
                continue
            game = copy.deepcopy(request.env)
            shown = game.render()
            moves = solve(game.room)[: self.max_actions]
            for move in moves:
                game.step(move)
            text = (f" <observation>{shown}</observation> I push the box. "
                    f"<prediction>{game.render()}</prediction> </think> "
                    f"<answer> {' || '.join(moves)} </answer>")
            completions.append(Completion(token_ids=[], text=text))
        return completions

    def release(self, keys):
        pass

    def close(self):
        pass


def eval_config(tmp_path, *sets):
    return load_config(None, [f"eval.out={tmp_path / 'report.json'}", "env.name=sokoban",
                              f"eval.seeds={len(SOLVERS)}", f"eval.n={N}", "eval.pass_k=4", "quiet=true",
                              "rollout.backend=hf",
                              "model.name=my-org/my-model", *sets])


def exact_pass_at_k(n, c, k):
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.fixture
def scripted_report(tmp_path):
    config = eval_config(tmp_path)
    report = evaluate.run(config, backend=ScriptedBackend(SOLVERS))
    return config, report


def test_scripted_policy_gives_exactly_the_expected_numbers(scripted_report):
    _, report = scripted_report
    assert report["per_seed"] == [{"seed": seed, "n": N, "successes": len(samples)}
                                  for seed, samples in SOLVERS.items()]
    figures = report["metrics"]
    assert figures["pass@1"] == pytest.approx(7 / 16)
    assert figures["success_rate"] == pytest.approx(7 / 16)
    for k in range(1, N + 1):
        expected = sum(exact_pass_at_k(N, len(s), k) for s in SOLVERS.values()) / len(SOLVERS)
        assert figures["pass_at_k"][str(k)] == pytest.approx(expected)
    assert figures["pass_at_k"]["4"] == pytest.approx(3 / 4)  # seeds with any success
    assert figures["episodes"] == 16
    # Solvers never write a bad action; garbage turns write none.
    assert figures["action_validity"] == 1.0
    # Non-solvers use all 5 turns with malformed output.
    assert figures["format_valid_rate"] < 1.0
    assert figures["mean_format_penalty"] == pytest.approx(-0.1 * 5 * 9 / 16)
    # The scripted observation/prediction are the truth: the rollout's state/next_state agree.
    wm = figures["world_model"]
    assert wm["observation"]["exact_match"] == 1.0 and wm["prediction"]["exact_match"] == 1.0
    assert wm["observation"]["cell_accuracy"] == 1.0 and wm["prediction"]["cell_accuracy"] == 1.0
    assert 0 < wm["observation"]["coverage"] < 1


def test_trajectories_are_written_and_match_the_report(scripted_report, tmp_path):
    _, report = scripted_report
    path = tmp_path / "report.trajectories.jsonl"
    assert report["trajectories"] == str(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted((row["seed"], row["sample"]) for row in rows) == [(s, i) for s in SOLVERS for i in range(N)]
    for row in rows:
        assert row["success"] == (row["sample"] in SOLVERS[row["seed"]])
        for turn in row["turns"]:
            if turn["prediction"] is not None:
                assert states_match(turn["prediction"], turn["next_state"])
    # The report on disk is the report returned.
    assert json.loads((tmp_path / "report.json").read_text()) == report


def test_report_records_every_setting(scripted_report):
    _, report = scripted_report
    settings = report["settings"]
    assert report["format"] == reports.REPORT_FORMAT and report["format_version"] == reports.REPORT_VERSION
    expected = {
        "model": "my-org/my-model", "backend": "hf", "env": "sokoban", "env_options": {},
        "render_mode": "coords", "prompt_mode": "base", "seeds": 4, "first_seed": FIRST_SEED,
        "n": N, "k": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 400, "max_turns": 5,
        "max_actions_per_turn": 5, "max_actions_per_traj": 10, "history_window": None, "format_penalty": -0.1,
        "sample_seed": 0, "state_ppl": False, "dtype": "float32",  # auto: fp32 under the tests (conftest)
    }
    assert {key: settings[key] for key in expected} == expected
    assert settings["versions"]["python"] and "spa_version" in settings


def test_defaults_are_the_papers_protocol(tmp_path):
    config = load_config(None, [])
    assert runner.sample_plan(config.eval) == (8, 8)
    seeds = runner.eval_seeds(config.eval)
    assert seeds[0] == 123 and len(seeds) == 128 and max(seeds) < 10000  # disjoint from training seeds
    rollout = config.rollout
    assert (rollout.temperature, rollout.top_p, rollout.max_new_tokens) == (1.0, 1.0, 400)


def test_settings_from_the_config_reach_the_rollout(tmp_path):
    config = eval_config(tmp_path, "eval.render_mode=text", "eval.prompt_mode=world_model", "eval.first_seed=200",
                         "eval.seeds=2", "eval.n=2", "eval.pass_k=2", "rollout.max_turns=2")
    backend = ScriptedBackend({})
    report = evaluate.run(config, backend=backend)
    rows = [json.loads(line) for line in Path(report["trajectories"]).read_text().splitlines()]
    assert sorted({row["seed"] for row in rows}) == [200, 201]
    assert all(row["prompt_mode"] == "world_model" and len(row["turns"]) == 2 for row in rows)
    assert all(row["render_mode"] == "text" for row in rows)
    assert all("Player" not in turn["state"] for row in rows for turn in row["turns"])  # no coordinate line
    assert report["settings"]["render_mode"] == "text" and report["metrics"]["pass@1"] == 0.0
    assert report["settings"]["prompt_mode"] == "world_model"


def test_an_interrupted_eval_resumes_and_other_settings_are_refused(tmp_path):
    config = eval_config(tmp_path)
    evaluate.run(config, backend=ScriptedBackend(SOLVERS))
    path = tmp_path / "report.trajectories.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:10]) + lines[10][:25])  # killed while writing episode 11
    with pytest.raises(UserError, match=r"already holds a eval run; add --resume to continue it"):
        evaluate.run(config, backend=ScriptedBackend(SOLVERS))
    backend = ScriptedBackend(SOLVERS)
    report = evaluate.run(eval_config(tmp_path, "eval.resume=true"), backend=backend)
    assert report["metrics"]["episodes"] == 16 and report["metrics"]["pass@1"] == pytest.approx(7 / 16)
    assert len(path.read_text().splitlines()) == 16
    # Another dtype samples other episodes: it may not continue them.
    with pytest.raises(UserError, match=r"other settings \(dtype: 'float32' -> 'bfloat16'\)"):
        evaluate.run(eval_config(tmp_path, "model.dtype=bfloat16", "eval.resume=true"), backend=ScriptedBackend({}))
    # A different temperature is another eval: it may not continue this one, nor replace it unasked.
    with pytest.raises(UserError, match=r"other settings \(temperature: 1.0 -> 0.5\)"):
        evaluate.run(eval_config(tmp_path, "rollout.temperature=0.5", "eval.resume=true"), backend=ScriptedBackend({}))
    assert len(path.read_text().splitlines()) == 16


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("sets, message", [
    (["eval.pass_k=9", "eval.n=8"], "--pass-k 9 is larger than --n 8"),
    (["eval.pass_k=9", "eval.n=null"], None),  # n defaults to k: fine
    (["eval.seeds=0"], "eval.seeds must be >= 1, got 0"),
    (["eval.n=0"], "eval.n must be >= 1, got 0"),
    (["eval.pass_k=0", "eval.n=4"], "eval.pass_k must be >= 1, got 0"),
])
def test_sample_plan_refuses_bad_counts(tmp_path, sets, message):
    if message is not None and "larger" not in message:  # a bad count is refused when the config is built
        with pytest.raises(UserError) as err:
            eval_config(tmp_path, *sets)
        assert str(err.value) == message
        return
    config = eval_config(tmp_path, *sets)
    if message is None:
        assert runner.sample_plan(config.eval) == (9, 9)
        return
    with pytest.raises(UserError) as err:
        runner.sample_plan(config.eval)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_pass_k_larger_than_n_is_refused_before_playing(tmp_path):
    backend = ScriptedBackend(SOLVERS)
    with pytest.raises(UserError, match="larger than --n"):
        evaluate.run(eval_config(tmp_path, "eval.pass_k=5"), backend=backend)
    assert backend.calls == 0 and not (tmp_path / "report.json").exists()


def test_a_checkpoint_without_weights_is_a_user_error(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    config = eval_config(tmp_path, f"model.name={checkpoint}")
    with pytest.raises(UserError, match="has no weights"):
        evaluate.run(config)


def test_an_unknown_env_option_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="has no option 'boxes'"):
        evaluate.run(eval_config(tmp_path, "env.options={boxes: 2}"), backend=ScriptedBackend(SOLVERS))


# ---- compare ---------------------------------------------------------------------------------


def write_report(tmp_path, name, pass1, passk, model="m", per_seed=(), **settings):
    base = {"model": model, "backend": "hf", "env": "sokoban", "env_options": {}, "render_mode": "coords",
            "prompt_mode": "world_model", "seeds": 128, "first_seed": 123, "n": 8, "k": 8, "temperature": 1.0,
            "top_p": 1.0, "max_new_tokens": 400, "max_turns": 5, "versions": {"python": "3.x"}}
    report = {"format": reports.REPORT_FORMAT, "format_version": reports.REPORT_VERSION,
              "settings": {**base, **settings},
              "metrics": {"pass@1": pass1, "pass_at_k": {"1": pass1, "8": passk},
                          "world_model": {"observation": {"exact_match": 0.9, "cell_accuracy": 0.99},
                                          "prediction": {"exact_match": 0.2, "cell_accuracy": 0.9}}},
              "per_seed": list(per_seed)}
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return path


def test_compare_lays_reports_side_by_side(tmp_path):
    from rich.console import Console

    a = write_report(tmp_path, "a.json", 0.163, 0.473, model="Qwen2.5-1.5B-Instruct")
    b = write_report(tmp_path, "b.json", 0.598, 0.695, model="runs/ppo", backend="vllm",
                     versions={"python": "other"})
    rows = reports.compare_rows([a, b])
    assert [(r["model"], r["pass@1"], r["pass@k"], r["k"]) for r in rows] == [
        ("Qwen2.5-1.5B-Instruct", 0.163, 0.473, 8), ("runs/ppo", 0.598, 0.695, 8)]
    console = Console(width=200, record=True)
    console.print(tables.compare([a, b]))
    text = console.export_text()
    assert "Pass@8" in text and "59.8" in text and "69.5" in text and "16.3" in text and "20.0" in text


def test_compare_gives_each_report_minus_the_first_over_shared_puzzles(tmp_path):
    from rich.console import Console

    per_seed = [{"seed": 123 + i, "n": 8, "successes": c} for i, c in enumerate((0, 2, 4, 8))]
    better = [{**row, "successes": min(8, row["successes"] + 2)} for row in per_seed]
    a = write_report(tmp_path, "a.json", 0.4375, 0.75, per_seed=per_seed)
    b = write_report(tmp_path, "b.json", 0.625, 1.0, per_seed=better)
    rows = reports.compare_rows([a, b])
    assert rows[0]["pass@1_vs_first"] is None and rows[0]["pass@k_vs_first"] is None
    diff, low, high = rows[1]["pass@1_vs_first"]
    # Per seed +2/8, +2/8, +2/8, 0: a resample holds the 0 three or four times with chance 0.05
    # (mean 1/16 or 0), and never with chance 0.32 (mean 1/4).
    assert (diff, low, high) == pytest.approx((3 / 16, 1 / 16, 1 / 4))
    # Pass@8 per seed: 0, 1, 1, 1 vs 1, 1, 1, 1. A resample of 4 seeds holds the differing one
    # 0 times with chance 0.32 and 3 or 4 times with chance 0.05: the interval is [0, 3/4].
    assert rows[1]["pass@k_vs_first"] == (0.25, 0.0, 0.75)
    console = Console(width=200, record=True)
    console.print(tables.compare([a, b]))
    assert f"+18.8 [{100 * low:+.1f}, {100 * high:+.1f}]" in console.export_text()


def test_compare_puts_arms_with_other_prompts_and_renders_side_by_side(tmp_path):
    """The paper's arms differ in what the model is shown (Vanilla RL: raw grid; VAGEN: the
    world-model prompt); their reports compare, and the table says which is which."""
    from rich.console import Console

    a = write_report(tmp_path, "a.json", 0.1, 0.2, prompt_mode="base", render_mode="text", dtype="float32")
    b = write_report(tmp_path, "b.json", 0.3, 0.4, prompt_mode="world_model", render_mode="coords", dtype="bfloat16")
    rows = reports.compare_rows([a, b])  # models in either dtype compare, as models do
    assert [(r["prompt_mode"], r["render_mode"]) for r in rows] == [("base", "text"), ("world_model", "coords")]
    console = Console(width=200, record=True)
    console.print(tables.compare([a, b]))
    text = console.export_text()
    assert "base, text" in text and "world_model, coords" in text


@pytest.mark.parametrize("setting, value", [("temperature", 0.7), ("env", "sudoku"), ("n", 16),
                                            ("max_turns", 3), ("seeds", 64)])
def test_compare_refuses_different_settings_unless_forced(tmp_path, setting, value):
    a = write_report(tmp_path, "a.json", 0.1, 0.2)
    b = write_report(tmp_path, "b.json", 0.3, 0.4, **{setting: value})
    with pytest.raises(UserError) as err:
        tables.compare([a, b])
    assert f"{setting}=" in str(err.value) and "--force" in str(err.value) and "\n" not in str(err.value)
    assert len(reports.compare_rows([a, b], force=True)) == 2
    tables.compare([a, b], force=True)


def test_compare_refuses_what_is_not_a_current_report(tmp_path):
    good = write_report(tmp_path, "good.json", 0.1, 0.2)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"pass@1": 0.5}))
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**json.loads(good.read_text()), "format_version": 0}))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(UserError, match="is not a spa eval report"):
        tables.compare([good, other])
    with pytest.raises(UserError, match="format version 0"):
        tables.compare([good, old], force=True)
    with pytest.raises(UserError, match="cannot read"):
        tables.compare([broken])
    with pytest.raises(UserError, match="does not exist"):
        tables.compare([tmp_path / "missing.json"])


def test_a_real_report_compares_with_itself(scripted_report, tmp_path):
    path = tmp_path / "report.json"
    rows = reports.compare_rows([path, path])
    assert rows[0]["pass@1"] == pytest.approx(7 / 16) and rows[0]["pass@k"] == pytest.approx(3 / 4)
    assert rows[0]["observation_exact"] == 1.0


# ---- showing and plotting --------------------------------------------------------------------


def test_print_report_shows_the_figures(scripted_report):
    from rich.console import Console

    _, report = scripted_report
    console = Console(width=200, record=True)
    tables.print_report(report, console)
    text = console.export_text()
    assert "43.8" in text  # Pass@1 = 7/16
    assert "75.0" in text  # Pass@4
    assert "world model" in text and "action validity" in text


def test_plot_pass_at_k(scripted_report, tmp_path):
    _, report = scripted_report
    path = plots.plot_pass_at_k(report, tmp_path / "plots" / "passk.png")
    assert path.read_bytes().startswith(b"\x89PNG")


# ---- state perplexity ------------------------------------------------------------------------


def test_state_perplexity_protocol(tokenizer, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    import envs
    from stages.agent import prompts

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    result = state_perplexity(model, tokenizer, EnvConfig(name="sokoban"), [123], prompt_mode="world_model",
                              random_actions=0)
    raw, coords = result["raw"], result["coords"]
    assert raw["states"] == coords["states"] == 1
    assert coords["tokens"] > raw["tokens"] > 0
    assert raw["ppl"] == pytest.approx(math.exp(raw["nll"]))

    # The same number by another route: the model's own loss with every non-state token masked.
    env = envs.make("sokoban", render_mode="coords")
    env.reset(seed=123)
    state = env.render_text(coordinates=False)
    chat = prompts.build_messages(prompts.instruction_prefix(env, "world_model", 10),
                                  [prompts.turn_block(1, state, 10, "world_model", 100)], [], [])
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    start = text.index("State:\n" + state) + len("State:\n")
    context = tokenizer.encode(text[:start], add_special_tokens=False)
    target = tokenizer.encode(text[:start + len(state)], add_special_tokens=False)[len(context):]
    assert tokenizer.decode(target) == state
    assert raw["tokens"] == len(target)
    ids = torch.tensor([context + target])
    labels = torch.tensor([[-100] * len(context) + target])
    with torch.no_grad():
        loss = model(ids, labels=labels).loss
    assert raw["nll"] == pytest.approx(float(loss), rel=1e-4)


def test_state_perplexity_averages_over_tokens_of_all_states(tokenizer, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    one = [state_perplexity(model, tokenizer, EnvConfig(name="sudoku"), [seed], prompt_mode="base")
           for seed in (123, 124)]
    both = state_perplexity(model, tokenizer, EnvConfig(name="sudoku"), [123, 124], prompt_mode="base")
    for view in ("raw", "coords"):
        nll = sum(r[view]["nll"] * r[view]["tokens"] for r in one)
        tokens = sum(r[view]["tokens"] for r in one)
        assert both[view]["tokens"] == tokens and both[view]["states"] == 2
        assert both[view]["nll"] == pytest.approx(nll / tokens, rel=1e-5)


def test_eval_with_state_ppl_reports_and_shows_it(tmp_path, tiny_model_dir):
    from rich.console import Console

    config = eval_config(tmp_path, f"model.name={tiny_model_dir}", "eval.state_ppl=true", "eval.seeds=2",
                         "eval.n=1", "eval.pass_k=1")
    report = evaluate.run(config, backend=ScriptedBackend(SOLVERS))
    ppl = report["metrics"]["state_perplexity"]
    assert ppl["model"] == str(tiny_model_dir) and ppl["seeds"] == [123, 124]
    assert ppl["raw"]["states"] == 2 and ppl["raw"]["ppl"] > 1
    assert ppl["coords"]["tokens"] > ppl["raw"]["tokens"]
    console = Console(width=200, record=True)
    tables.print_report(report, console)
    assert "state perplexity" in console.export_text()


def test_eval_says_what_it_will_do_and_counts_turns_as_they_come_back(tmp_path, tiny_model_dir, monkeypatch,
                                                                        capsys):
    from stages.common import console

    log = io.StringIO()  # a log file, not a terminal: plain progress lines
    monkeypatch.setattr(console.sys, "stderr", log)
    monkeypatch.setattr(console, "LOG_EVERY_S", 0.0)  # a line for every update
    config = eval_config(tmp_path, f"model.name={tiny_model_dir}", "model.device=cpu", "eval.seeds=2", "eval.n=2",
                         "eval.pass_k=2", "rollout.max_new_tokens=3", "rollout.max_turns=2", "quiet=false",
                         "eval.state_ppl=true")
    report = evaluate.run(config)
    assert capsys.readouterr().out.splitlines()[0] == (
        f"eval: 2 puzzles x 2 samples = 4 episodes of up to 2 turns on sokoban (base prompt, coords states), then "
        f"the state perplexity; model {tiny_model_dir}, hf backend on cpu (float32); -> {config.eval.out}")
    lines = [line for line in log.getvalue().splitlines() if line.startswith("eval")]  # not the model load's
    turns = [re.match(r"eval: (\d+)/8 turns \(\d+%\) episodes (\d+)/4", line) for line in lines]
    counted = [(int(m[1]), int(m[2])) for m in turns if m]
    # the 4 episodes play together: 4 turns come back with each call, before any episode ends
    assert [done for done, finished in counted if finished == 0] == [0] * 4 + [4] * 4 + [8]
    assert counted[-1] == (8, 4)
    assert lines[len(counted):] == [f"eval state perplexity: {n}/2 states ({50 * n}%); " + line.split("; ")[1]
                                    for n, line in zip((1, 2), lines[len(counted):])]
    assert report["metrics"]["state_perplexity"]["raw"]["states"] == 2


# ---- through the command line ----------------------------------------------------------------


def cli(*args):
    from typer.testing import CliRunner

    from spa_cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def last_line(result):
    return [line for line in result.output.splitlines() if line.strip()][-1]


def test_cli_eval_writes_report_table_and_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "make_backend", lambda model, rollout, prompt_mode: ScriptedBackend(SOLVERS))
    out, plot = tmp_path / "report.json", tmp_path / "passk.png"
    result = cli("eval", "--env", "sokoban", "--seeds", 4, "--n", 4, "--pass-k", 4, "--temperature", 1.0,
                 "--out", out, "--plot", plot, "--quiet")
    assert result.exit_code == 0, result.output
    assert "43.8" in result.output and "75.0" in result.output
    assert json.loads(out.read_text())["per_seed"][0] == {"seed": 123, "n": 4, "successes": 4}
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("args, message", [
    (["--pass-k", 9, "--n", 8], "error: --pass-k 9 is larger than --n 8"),
    (["--model", "{ckpt}", "--backend", "hf"], "error: model directory {ckpt} has no weights"),
    (["--env", "sokobn"], "error: unknown env 'sokobn'"),
])
def test_cli_eval_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    args = [str(a).replace("{ckpt}", str(ckpt)) for a in args]
    result = cli("eval", *args, "--out", tmp_path / "r.json", "--quiet")
    assert result.exit_code == 2, result.output
    assert last_line(result).startswith(message.replace("{ckpt}", str(ckpt))), result.output
    assert "Traceback" not in result.output


def test_cli_compare_refuses_then_forces(tmp_path):
    a = write_report(tmp_path, "a.json", 0.1, 0.2)
    b = write_report(tmp_path, "b.json", 0.3, 0.4, env="sudoku")
    refused = cli("eval", "compare", a, b)
    assert refused.exit_code == 2 and "env='sudoku'" in last_line(refused)
    forced = cli("eval", "compare", a, b, "--force")
    assert forced.exit_code == 0 and "30.0" in forced.output
    not_report = tmp_path / "x.json"
    not_report.write_text("[1, 2]")
    assert cli("eval", "compare", a, not_report).exit_code == 2


# ---- with the real backends ------------------------------------------------------------------


def random_eval_config(out):
    return load_config(None, [f"eval.out={out}", "rollout.backend=random", "eval.seeds=3", "eval.n=2",
                              "eval.pass_k=2", "quiet=true", "env.name=frozen_lake", "eval.prompt_mode=world_model"])


def test_random_backend_end_to_end(tmp_path):
    report = evaluate.run(random_eval_config(tmp_path / "random.json"))
    assert report["settings"]["model"] == "random" and report["settings"]["backend"] == "random"
    figures = report["metrics"]
    assert figures["episodes"] == 6
    assert figures["format_valid_rate"] == 1.0 and figures["action_validity"] == 1.0
    assert [row["n"] for row in report["per_seed"]] == [2, 2, 2]
    successes = sum(row["successes"] for row in report["per_seed"])
    assert figures["pass@1"] == pytest.approx(successes / 6)
    # Empty <observation></observation> tags are written and wrong.
    assert figures["world_model"]["observation"]["coverage"] == 1.0
    assert figures["world_model"]["observation"]["exact_match"] == 0.0
    # Same settings, same numbers: the eval is reproducible.
    again = evaluate.run(random_eval_config(tmp_path / "again.json"))
    assert again["per_seed"] == report["per_seed"] and again["metrics"] == report["metrics"]


def test_hf_backend_end_to_end_with_a_tiny_model(tmp_path, tiny_model_dir):
    config = load_config(None, [f"eval.out={tmp_path / 'tiny.json'}", f"model.name={tiny_model_dir}",
                                "rollout.backend=hf", "eval.seeds=2", "eval.n=2", "eval.pass_k=2",
                                "rollout.max_new_tokens=8", "rollout.max_turns=2", "quiet=true",
                                "env.name=sudoku"])
    report = evaluate.run(config)
    assert report["settings"]["model"] == str(tiny_model_dir) and report["settings"]["max_new_tokens"] == 8
    figures = report["metrics"]
    # A random model writes no valid format in 8 tokens: no success, every turn penalised.
    assert figures["episodes"] == 4 and figures["pass@1"] == 0.0 and figures["pass_at_k"]["2"] == 0.0
    assert figures["format_valid_rate"] == 0.0 and figures["mean_turns"] == 2.0
    rows = [json.loads(line) for line in Path(report["trajectories"]).read_text().splitlines()]
    assert all(len(row["turns"]) == 2 and row["turns"][0]["response"].startswith("<think>") for row in rows)
