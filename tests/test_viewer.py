"""`spa view`: the page's data (grids with the wrong cells marked as the metrics count them), a page
that fetches nothing and runs no model output, refusals of files of another kind, and (slow) the
page in a real headless Chromium."""

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spa_cli.main import app
from stages.evaluation import metrics

runner = CliRunner()

TRUE = "######\n#_X0_#\n#P___#\n######\nPlayer (P) is at (2,1); box (X) is at (1,2); target (0) is at (1,3)."
NEXT = "######\n#_X0_#\n#_P__#\n######\nPlayer (P) is at (2,2); box (X) is at (1,2); target (0) is at (1,3)."


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def page_data(path: Path) -> dict:
    return json.loads(path.read_text().split('id="spa-data">')[1].split("</script>")[0])


def trajectory(seed: int, success: bool, model: str, observation: str | None, prediction: str | None,
               response: str = "<think>...</think><answer>Right</answer>") -> dict:
    turn = {"state": TRUE, "response": response, "observation": observation, "prediction": prediction,
            "thoughts": "", "actions": ["Right", "Jump"], "executed": ["Right"], "reward": -0.1,
            "next_state": NEXT, "format_ok": True, "done": True, "penalty": 0.0, "action_valid": [True, False],
            "action_effective": [True]}
    return {"id": f"sokoban-{seed}-0", "env": "sokoban", "seed": seed, "group": 0, "sample": 0,
            "prompt_mode": "world_model", "model": model, "turns": [turn], "messages": [], "success": success,
            "total_reward": -0.1, "format_penalty": 0.0}


@pytest.fixture
def episodes_file(tmp_path) -> Path:
    wrong_observation = TRUE.replace("#P___#", "#_P__#")  # the player one cell off: 2 wrong cells
    rows = [trajectory(123, True, "sft", wrong_observation, NEXT),
            trajectory(124, False, "sft", None, "garbage"),
            trajectory(123, False, "base", TRUE, NEXT, response="</script><script>alert(1)</script>")]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_each_turn_compares_the_models_states_with_the_true_ones_cell_by_cell(episodes_file, tmp_path):
    out = tmp_path / "view.html"
    result = invoke("view", episodes_file, "--out", out)
    assert result.exit_code == 0, result.output
    assert result.output == f"{out}: 3 episodes (base, sft); open it in a browser\n"
    episodes = page_data(out)["episodes"]
    assert [(e["arm"], e["seed"], e["success"]) for e in episodes] == [("sft", 123, True), ("sft", 124, False),
                                                                         ("base", 123, False)]
    observation = episodes[0]["turns"][0]["observation"]
    wrong = [(r, c) for r, row in enumerate(observation["grids"]["written"]) for c, (_, right) in enumerate(row)
             if not right]
    assert wrong == [(2, 1), (2, 2)]  # "_" where the player is, "P" one cell right
    truth_wrong = [(r, c) for r, row in enumerate(observation["grids"]["truth"]) for c, (_, ok) in enumerate(row)
                   if not ok]
    assert truth_wrong == [(2, 1), (2, 2)]
    assert observation["cells"] == metrics.cell_accuracy(observation["written"], TRUE) == 22 / 24
    assert observation["exact"] is False and episodes[0]["turns"][0]["prediction"]["exact"] is True
    unwritten = episodes[1]["turns"][0]["observation"]  # no tag: nothing marked wrong, no verdict
    assert unwritten["written"] is None and unwritten["exact"] is None
    assert unwritten["grids"]["written"] is None and all(ok for row in unwritten["grids"]["truth"] for _, ok in row)
    garbage = episodes[1]["turns"][0]["prediction"]  # a one-row "grid" of 7 cells against 4 rows of 6
    assert garbage["cells"] == metrics.cell_accuracy("garbage", NEXT) and garbage["exact"] is False
    turn = episodes[2]["turns"][0]
    assert (turn["actions"], turn["valid"], turn["executed"], turn["reward"], turn["penalty"]) == (
        ["Right", "Jump"], [True, False], ["Right"], -0.1, 0.0)


def test_the_page_fetches_nothing_and_model_output_stays_data(episodes_file, tmp_path):
    out = tmp_path / "view.html"
    assert invoke("view", episodes_file, "--out", out).exit_code == 0
    page = out.read_text()
    assert re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", page) == ["data:,"]  # the empty favicon
    assert "http://" not in page and "https://" not in page and "@import" not in page
    assert page.count("<script") == 2 and page.count("</script>") == 2  # the data and the code, nothing else
    assert page_data(out)["episodes"][2]["turns"][0]["response"] == "</script><script>alert(1)</script>"
    assert "innerHTML" not in page  # the script writes text only


def test_an_eval_report_shows_its_episodes(tmp_path):
    result = invoke("eval", "--backend", "random", "--seeds", "2", "--pass-k", "2", "--out", tmp_path / "a" / "r.json",
                    "-q")
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "a" / "r.trajectories.jsonl").read_text().splitlines()
    shutil.move(tmp_path / "a", tmp_path / "b")  # the report records a path that is gone; its episodes are beside it
    result = invoke("view", tmp_path / "b" / "r.json", "--out", tmp_path / "v.html")
    assert result.exit_code == 0, result.output
    episodes = page_data(tmp_path / "v.html")["episodes"]
    assert len(episodes) == len(lines) == 4 and {e["arm"] for e in episodes} == {"r"}
    assert [e["id"] for e in episodes] == [json.loads(line)["id"] for line in lines]


@pytest.fixture
def other_files(tmp_path, episodes_file) -> Path:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "lr": 1e-4}) + "\n")
    (tmp_path / "sft.jsonl").write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]})
                                        + "\n")
    (tmp_path / "manifest.json").write_text(json.dumps({"stage": "generate", "config": {}}, indent=2))
    (tmp_path / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "lonely.json").write_text(json.dumps({"format": "spa-eval-report", "format_version": 1,
                                                      "settings": {}, "trajectories": "gone.jsonl"}))
    return tmp_path


EXPECTS = "spa view expects a run directory (pipeline, sft or ppo), an eval report.json or a trajectories.jsonl"


@pytest.mark.parametrize("given, says", [
    ("metrics.jsonl", f"metrics.jsonl is the metrics.jsonl of a sft run (view its directory, or spa plot it); {EXPECTS}"),
    ("sft.jsonl", f"sft.jsonl holds SFT rows (spa clean), not episodes; {EXPECTS}"),
    ("manifest.json", f"manifest.json is a JSON file but not a spa eval report; {EXPECTS}"),
    ("picture.png", f"picture.png is not UTF-8 text; {EXPECTS}"),
    ("notes.txt", f"notes.txt:1: not valid JSON (Expecting value); {EXPECTS}"),
    ("empty", f"empty holds no spa run (no table.md, metrics.jsonl or eval reports); {EXPECTS}"),
    ("missing", f"missing does not exist; {EXPECTS}"),
    ("lonely.json", ("the episodes of lonely.json (gone.jsonl) are missing; spa view needs the report's "
                     "trajectories.jsonl beside it")),
])
def test_spa_view_on_another_kind_of_file_says_what_it_expects(given, says, other_files, monkeypatch):
    monkeypatch.chdir(other_files)
    result = invoke("view", given, "--out", "view.html")
    assert result.exit_code == 2
    assert result.stderr == f"error: {says}\n"
    assert not (other_files / "view.html").exists()


# ---- in a real browser ----------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def browse(page_path: Path, screenshot: Path, actions=None) -> dict:
    """Open the page in headless Chromium (playwright driving the system's browser): the console
    errors, the requests made, the episode count shown (after `actions`), and a screenshot."""
    from playwright.sync_api import sync_playwright

    found: dict = {"errors": [], "requests": []}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda message: found["errors"].append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: found["errors"].append(str(error)))
            page.on("request", lambda request: found["requests"].append(request.url))
            page.goto(page_path.resolve().as_uri())
            found["count"] = page.text_content("#episode-count")
            if actions:
                found |= actions(page)
            page.screenshot(path=str(screenshot))
        finally:
            browser.close()
    return found


def not_blank(png: Path) -> int:
    """How many distinct colours the screenshot has (a blank page has one)."""
    from matplotlib import image

    pixels = image.imread(png)
    return len({tuple(pixel) for pixel in pixels.reshape(-1, pixels.shape[-1])[::7]})


@pytest.mark.slow
def test_the_page_in_headless_chromium(tmp_path, tiny_model_dir):
    if CHROMIUM is None:
        pytest.skip("no Chromium on this machine (Debian: apt install chromium)")
    pytest.importorskip("playwright", reason="`make test-slow` installs playwright (pip install -e '.[browser]')")
    # a trajectories file and a whole pipeline run directory, made by spa itself
    trajectories = tmp_path / "t.jsonl"
    assert invoke("generate", "--backend", "random", "--groups", "5", "--group-size", "2", "--out", trajectories,
                  "-q").exit_code == 0
    run_dir = tmp_path / "run"
    result = invoke("pipeline", "--dir", run_dir, "-q", "--set", f"model.name={tiny_model_dir}",
                    "--set", "pipeline.data_policy=random", "--set", "pipeline.data_groups=3",
                    "--set", "rollout.groups=2", "--set", "rollout.group_size=2", "--set", "rollout.max_turns=1",
                    "--set", "rollout.max_new_tokens=8", "--set", "sft.epochs=1", "--set", "sft.global_batch=2",
                    "--set", "sft.zero_stage=0", "--set", "ppo.steps=1", "--set", "ppo.filter_ratio=1.0",
                    "--set", "ppo.mini_batch=2", "--set", "ppo.zero_stage=0", "--set", "ppo.val_every=0",
                    "--set", "eval.seeds=2", "--set", "eval.pass_k=2")
    assert result.exit_code == 0, result.output

    lines = trajectories.read_text().splitlines()
    solved = sum(json.loads(line)["success"] for line in lines)
    page = tmp_path / "trajectories.html"
    assert invoke("view", trajectories, "--out", page).exit_code == 0

    def filter_solved(browser_page):
        browser_page.select_option("#filter-success", "1")
        shown = browser_page.text_content("#episode-count")
        browser_page.select_option("#filter-success", "")
        browser_page.select_option("#filter-seed", "10001")
        return {"solved": shown, "seed": browser_page.text_content("#episode-count"),
                "cells": browser_page.locator("#episode table.grid td").count()}

    found = browse(page, tmp_path / "trajectories.png", filter_solved)
    assert found["errors"] == [] and found["requests"] == [page.resolve().as_uri()]
    assert found["count"] == f"{len(lines)} episodes"
    assert found["solved"] == (f"{solved} of {len(lines)} episodes" if solved != len(lines) else f"{solved} episodes")
    assert found["seed"] == f"2 of {len(lines)} episodes"
    assert found["cells"] > 0  # the shown turn's boards are drawn as grids
    assert not_blank(tmp_path / "trajectories.png") > 10

    page = tmp_path / "run.html"
    assert invoke("view", run_dir, "--out", page).exit_code == 0
    reports = sorted((run_dir / "eval").glob("*.trajectories.jsonl"))  # every arm's eval: the page holds them all
    assert len(reports) >= 3
    episodes = sum(len(path.read_text().splitlines()) for path in reports)
    found = browse(page, tmp_path / "run.png", lambda p: {"images": p.locator("section.run img").count(),
                                                          "loaded": p.evaluate(
                                                              "[...document.images].every(i => i.naturalWidth > 0)")})
    assert found["errors"] == [] and found["requests"] == [page.resolve().as_uri()]
    assert found["count"] == f"{episodes} episodes" and (found["images"], found["loaded"]) == (2, True)
    assert not_blank(tmp_path / "run.png") > 10
