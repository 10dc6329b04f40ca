"""`spa plot` and the Pass@k plots: PNGs of the size the layout gives, one line per run in every
panel, bands from the bootstrap, and one-line refusals of files of another kind."""

import json
from pathlib import Path

import pytest
from helpers import png_size
from typer.testing import CliRunner

from spa_cli.main import app
from stages.evaluation import metrics, plots

runner = CliRunner()


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sft_rows(steps: int, scale: float = 1.0) -> list[dict]:
    """Rows with the keys `spa sft` writes: val_loss at the end of each 2-step epoch."""
    return [{"step": s, "epoch": s / 2, "loss": scale * 3 / s, "val_loss": scale * 3.5 / s if s % 2 == 0 else None,
             "lr": 1e-4 * (1 - s / (steps + 1)), "grad_norm": 1.0, "tokens": 100, "trained_tokens": 40,
             "tokens_per_s": 50.0, "seconds": 2.0} for s in range(1, steps + 1)]


def ppo_rows(steps: int, with_kl: bool = False) -> list[dict]:
    """Rows with the keys `spa ppo` writes: step 0 is the validation before training."""
    rows = [{"step": 0, "val_pass@1": 0.1, "val_pass@4": 0.3, "val_reward": -0.1}]
    for s in range(1, steps + 1):
        row = {"step": s, "reward": 0.1 * s, "success": 0.05 * s, "format_penalty": -0.1, "turns": 2.0,
               "response_length": 40.0 + s, "entropy": 1.5, "clip_frac": 0.01, "ppo_kl": 0.001 * s,
               "pg_loss": 0.0, "value_loss": 0.5, "explained_variance": None}
        if with_kl:
            row["kl_ref"] = 0.002 * s
        if s == steps:
            row |= {"val_pass@1": 0.2, "val_pass@4": 0.4, "val_reward": 0.3}
        rows.append(row)
    return rows


@pytest.fixture
def pipeline_dir(tmp_path) -> Path:
    """A run directory as `spa pipeline` lays it out: sft/, ppo/ and ppo_vanilla/ with metrics."""
    root = tmp_path / "run"
    write_rows(root / "sft" / "metrics.jsonl", sft_rows(4))
    write_rows(root / "ppo" / "metrics.jsonl", ppo_rows(3))
    write_rows(root / "ppo_vanilla" / "metrics.jsonl", ppo_rows(3))
    (root / "eval").mkdir()
    return root


def visible_axes(figure):
    return {ax.get_title(): ax for ax in figure.axes if ax.get_visible()}


def test_pipeline_directory_gives_one_line_per_run_in_each_panel(pipeline_dir):
    runs = plots.runs_in(pipeline_dir)
    assert [(run.label, run.stage) for run in runs] == [("ppo", "ppo"), ("ppo_vanilla", "ppo"), ("sft", "sft")]
    figure = plots.curves_figure(runs)
    axes = visible_axes(figure)
    assert list(axes) == ["training loss", "validation loss", "learning rate", "reward", "success (%)",
                          "validation Pass@1 (%)", "validation Pass@k (%)", "KL, updated vs rollout policy",
                          "entropy", "clip fraction (%)", "response length (tokens)"]  # no kl_ref: not logged
    for title, ax in axes.items():
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels == (["sft"] if title in ("training loss", "validation loss", "learning rate")
                          else ["ppo", "ppo_vanilla"]), title
    val_loss = axes["validation loss"].get_lines()[0]
    assert list(val_loss.get_xdata()) == [2, 4] and list(val_loss.get_ydata()) == [3.5 / 2, 3.5 / 4]
    pass_k = axes["validation Pass@k (%)"].get_lines()[0]  # val_pass@4, in percent, before and after
    assert list(pass_k.get_xdata()) == [0, 3] and list(pass_k.get_ydata()) == pytest.approx([30.0, 40.0])
    assert list(axes["reward"].get_lines()[0].get_xdata()) == [1, 2, 3]  # step 0 has no rollout
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["ppo", "ppo_vanilla", "sft"]


def test_the_rollouts_world_model_accuracy_is_drawn_in_percent_where_a_step_defines_it(tmp_path):
    """The exact shares of observations, predictions and predictions of moves, one panel each; a step
    where no rollout turn wrote a prediction (null) is no point of those curves."""
    rows = ppo_rows(3)
    shares = {1: (0.5, 0.25, 0.125), 2: (0.75, None, None), 3: (1.0, 0.5, 0.0)}
    for row in rows[1:]:
        observation, prediction, of_change = shares[row["step"]]
        row |= {"wm_observation_exact": observation, "wm_prediction_exact": prediction,
                "wm_prediction_of_change_exact": of_change}
    figure = plots.curves_figure([plots.read_run(write_rows(tmp_path / "metrics.jsonl", rows))])
    axes = visible_axes(figure)
    drawn = {title: (list(line.get_xdata()), list(line.get_ydata()))
             for title in ("exact observations (%)", "exact predictions (%)", "exact predictions, state changed (%)")
             for line in axes[title].get_lines()}
    assert drawn == {"exact observations (%)": ([1, 2, 3], [50.0, 75.0, 100.0]),
                     "exact predictions (%)": ([1, 3], [25.0, 50.0]),
                     "exact predictions, state changed (%)": ([1, 3], [12.5, 0.0])}


def test_the_png_has_the_size_of_its_panel_grid(pipeline_dir, tmp_path):
    out = plots.plot_curves(plots.runs_in(pipeline_dir), tmp_path / "curves.png")
    columns, rows = plots.COLUMNS, 4  # 11 panels in rows of 3
    assert png_size(out) == (round(columns * plots.PANEL_SIZE[0] * plots.DPI),
                             round(rows * plots.PANEL_SIZE[1] * plots.DPI))


def test_spa_plot_overlays_several_runs_labelled_by_their_paths(tmp_path):
    first = write_rows(tmp_path / "a" / "metrics.jsonl", sft_rows(4))
    write_rows(tmp_path / "b" / "metrics.jsonl", sft_rows(4, scale=2.0))
    kl = write_rows(tmp_path / "c.jsonl", ppo_rows(2, with_kl=True))
    out = tmp_path / "curves.png"
    result = runner.invoke(app, ["plot", str(first), str(tmp_path / "b"), str(kl), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output == f"curves of 3 run(s) in {out}\n"
    assert png_size(out) == (1440, 4 * 340)  # 3 sft panels + 9 ppo panels (kl_ref too)
    figure = plots.curves_figure(plots.read_runs([first, tmp_path / "b", kl]))
    axes = visible_axes(figure)
    assert [line.get_label() for line in axes["training loss"].get_lines()] == [str(tmp_path / "a"),
                                                                                 str(tmp_path / "b")]
    assert [line.get_label() for line in axes["KL to the reference"].get_lines()] == [str(kl)]


def test_pass_at_k_band_is_the_bootstrap_of_the_per_seed_estimates():
    per_seed = [{"seed": 1, "n": 4, "successes": 0}, {"seed": 2, "n": 4, "successes": 2},
                {"seed": 3, "n": 4, "successes": 4}]
    band = metrics.pass_at_k_band(per_seed)
    assert list(band) == [1, 2, 3, 4]
    for k, (value, low, high) in band.items():
        estimates = [metrics.pass_at_k(4, c, k) for c in (0, 2, 4)]
        assert value == pytest.approx(sum(estimates) / 3)
        assert value == pytest.approx(metrics.pass_at_k_curve(per_seed)[k])
        # resampled means of three puzzles lie between the smallest and the largest estimate
        assert min(estimates) <= low <= value <= high <= max(estimates)
    assert band[1][1] < band[1][2]  # the puzzles differ, so the band has width
    same = [{"seed": s, "n": 2, "successes": 1} for s in range(5)]
    assert metrics.pass_at_k_band(same)[1] == (0.5, 0.5, 0.5)
    assert metrics.pass_at_k_band(per_seed) == band  # deterministic


def report(model: str, counts: list[int], n: int = 4) -> dict:
    per_seed = [{"seed": 123 + i, "n": n, "successes": c} for i, c in enumerate(counts)]
    curve = metrics.pass_at_k_curve(per_seed)
    return {"settings": {"model": model, "temperature": 1.0, "env": "sokoban"}, "per_seed": per_seed,
            "metrics": {"pass_at_k": {str(k): v for k, v in curve.items()}}}


def test_pass_at_k_figure_draws_a_line_and_a_band_per_report():
    reports = [report("base", [0, 1, 0, 2]), report("sft", [2, 3, 4, 1])]
    figure = plots.pass_at_k_figure(reports, ["base.json", "sft.json"])
    (ax,) = figure.axes
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["base.json", "sft.json"]
    assert list(lines[1].get_ydata()) == pytest.approx([100 * v for v in reports[1]["metrics"]["pass_at_k"].values()])
    assert len(ax.collections) == 2  # one band each
    band = metrics.pass_at_k_band(reports[0]["per_seed"])
    lows = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert min(lows) == pytest.approx(100 * min(low for _, low, _ in band.values()))


def test_a_pass_at_k_figure_of_many_reports_gives_each_its_own_color_and_a_legend_beside_the_axes():
    reports = [report(f"arm{i}", [i % 4, 1, 0, 2]) for i in range(11)]  # a pipeline's table has 11 rows
    figure = plots.pass_at_k_figure(reports, [f"arm{i}" for i in range(11)])
    (ax,) = figure.axes
    assert len({tuple(line.get_color()) for line in ax.get_lines()}) == 11
    figure.canvas.draw()
    assert ax.get_legend().get_window_extent().x0 > ax.get_window_extent().x1


def test_a_pipeline_draws_each_ppo_runs_validations_in_step_order(tmp_path, monkeypatch):
    """Fig. 7: the Pass@k curves of ppo/<id>/val/step-N.json, one per validation."""
    from types import SimpleNamespace

    from stages import pipeline
    from stages.evaluation import reports

    val = tmp_path / "ppo" / "spa" / "val"
    val.mkdir(parents=True)
    for step, counts in ((0, [0, 1, 0, 2]), (10, [3, 4, 2, 4]), (2, [1, 1, 2, 2])):
        written = {"format": reports.REPORT_FORMAT, "format_version": reports.REPORT_VERSION,
                   **report(f"step {step}", counts)}
        (val / f"step-{step}.json").write_text(json.dumps(written))
    (val / "step-0.json.manifest.json").write_text("{}")
    (tmp_path / "ppo" / "vanilla_rl").mkdir()  # validated never: no plot
    drawn = []
    draw = plots.plot_pass_at_k
    monkeypatch.setattr(plots, "plot_pass_at_k", lambda *args: drawn.append(args) or draw(*args))
    pipeline.write_plots(SimpleNamespace(dir=tmp_path, arms=[], rows={}))
    [(shown, path, names)] = drawn
    assert path == val / "pass_at_k.png" and png_size(path) == (600, 400)
    assert names == ["step 0", "step 2", "step 10"] and [r["settings"]["model"] for r in shown] == names


def test_eval_compare_plots_the_reports(tmp_path):
    paths = []
    for name in ("a", "b"):
        result = runner.invoke(app, ["eval", "--backend", "random", "--seeds", "3", "--pass-k", "2",
                                     "--out", str(tmp_path / f"{name}.json"), "-q"])
        assert result.exit_code == 0, result.output
        paths.append(str(tmp_path / f"{name}.json"))
    out = tmp_path / "passk.png"
    result = runner.invoke(app, ["eval", "compare", *paths, "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert png_size(out) == (600, 400)


@pytest.mark.parametrize("given, says", [
    ("report.json", ("report.json is not the metrics.jsonl of a spa sft or ppo run; spa plot expects the directory "
                     "of a spa sft, ppo or pipeline run, or a run's metrics.jsonl")),
    ("t.jsonl", "t.jsonl is not the metrics.jsonl of a spa sft or ppo run; spa plot expects"),
    ("empty", "empty holds no metrics.jsonl, nor do its sub-directories; spa plot expects"),
    ("missing", "missing does not exist; spa plot expects"),
    ("image.png", "image.png is not the metrics.jsonl of a spa sft or ppo run"),
])
def test_spa_plot_on_another_kind_of_file_says_what_it_expects(given, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report.json").write_text(json.dumps({"format": "spa-eval-report", "metrics": {}}, indent=2))
    (tmp_path / "t.jsonl").write_text(json.dumps({"id": "a", "turns": [], "seed": 1}) + "\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    result = runner.invoke(app, ["plot", given, "--out", "curves.png"])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {says}") and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "curves.png").exists()


def test_a_one_step_run_gets_its_figures_written_not_a_dot_on_an_axis(tmp_path):
    """A one-step PPO run (the demo's) has one point a panel: no panel draws it; its figures are
    written under the panels. Its one-point validation (step 1 only) is written too."""
    one_step = [{"step": 1, "reward": 0.19, "success": 0.0625, "entropy": 0.17,
                 "val_pass@1": 0.1, "val_pass@2": 0.15}]
    sft = write_rows(tmp_path / "sft" / "metrics.jsonl", sft_rows(4))
    ppo = write_rows(tmp_path / "ppo" / "metrics.jsonl", one_step)
    figure = plots.curves_figure(plots.read_runs([sft, ppo]))
    assert list(visible_axes(figure)) == ["training loss", "validation loss", "learning rate"]
    note = " ".join(figure.get_supxlabel().split())  # wrapped to the figure's width
    assert note.startswith(f"{tmp_path / 'ppo'}, one point each: reward 0.19 (step 1); success (%) 6.2 (step 1)")
    assert "validation Pass@1 (%) 10.0 (step 1)" in note and "entropy 0.17 (step 1)" in note
    assert [t.get_text() for t in figure.legends[0].get_texts()] == [str(tmp_path / "sft")]
    alone = plots.curves_figure(plots.read_runs([ppo]))  # nothing to draw but the note
    assert not visible_axes(alone) and alone.get_supxlabel().startswith(str(tmp_path / "ppo"))


def test_the_validation_figure_draws_pass_at_1_against_step_with_its_band():
    runs = [("spa", [(0, report("sft", [0, 1, 0, 2])), (10, report("sft", [2, 3, 4, 1]))]),
            ("vanilla", [(10, report("base", [0, 0, 1, 0])), (0, report("base", [0, 0, 0, 0]))])]
    (ax,) = plots.validation_figure(runs).axes
    spa, vanilla = ax.get_lines()
    assert list(spa.get_xdata()) == [0, 10] and list(vanilla.get_xdata()) == [0, 10]  # sorted by step
    assert list(spa.get_ydata()) == pytest.approx([100 * 3 / 16, 100 * 10 / 16])
    assert list(vanilla.get_ydata()) == pytest.approx([0.0, 100 / 16])
    bands = [band for band in ax.collections]
    assert len(bands) == 2
    low, high = bands[0].get_paths()[0].vertices[:, 1].min(), bands[0].get_paths()[0].vertices[:, 1].max()
    first = metrics.pass_at_k_band(report("sft", [0, 1, 0, 2])["per_seed"])[1]
    last = metrics.pass_at_k_band(report("sft", [2, 3, 4, 1])["per_seed"])[1]
    assert low == pytest.approx(100 * min(first[1], last[1])) and high == pytest.approx(100 * max(first[2], last[2]))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["spa", "vanilla"]


def write_validations(run: Path, counts: dict[int, list[int]]) -> Path:
    """A ppo run directory whose val/step-N.json reports hold `counts` (successes per puzzle, of 4)."""
    from stages.evaluation.reports import REPORT_FORMAT, REPORT_VERSION

    (run / "val").mkdir(parents=True)
    for step, successes in counts.items():
        body = report("m", successes) | {"format": REPORT_FORMAT, "format_version": REPORT_VERSION}
        (run / "val" / f"step-{step}.json").write_text(json.dumps(body))
    return run


def test_spa_plot_validation_draws_each_ppo_runs_validation_pass_at_1(tmp_path):
    first = write_validations(tmp_path / "a", {0: [0, 1, 0, 2], 10: [2, 3, 4, 1], 5: [1, 1, 1, 1]})
    second = write_validations(tmp_path / "b", {0: [0, 0, 0, 0], 10: [0, 0, 1, 0]})
    out = tmp_path / "validation.png"
    result = runner.invoke(app, ["plot", str(first), str(second), "--validation", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output == f"validation of 2 run(s) in {out}\n"
    assert png_size(out) == (600, 400)
    (ax,) = plots.validation_figure(plots.read_validations([first, second])).axes
    assert [list(line.get_xdata()) for line in ax.get_lines()] == [[0, 5, 10], [0, 10]]
    assert [line.get_label() for line in ax.get_lines()] == [str(first), str(second)]


def test_spa_plot_validation_refuses_a_run_without_validations_in_one_line(tmp_path):
    first = write_validations(tmp_path / "a", {0: [0, 1]})
    (tmp_path / "b").mkdir()
    result = runner.invoke(app, ["plot", str(first), str(tmp_path / "b"), "--validation"])
    assert result.exit_code == 2
    assert result.output == (f"error: {tmp_path / 'b'} holds no validation report (val/step-N.json); --validation "
                             "expects ppo run directories validated with ppo.val_every\n")


def test_the_pipeline_draws_each_validated_runs_pass_at_k_and_the_curves_of_those_validated_twice(tmp_path,
                                                                                                 monkeypatch):
    from types import SimpleNamespace

    from stages import pipeline

    write_validations(tmp_path / "ppo" / "spa", {0: [0, 1, 0, 2], 5: [2, 3, 4, 1]})
    write_validations(tmp_path / "ppo" / "once", {1: [1, 1, 1, 1]})
    (tmp_path / "ppo" / "unvalidated").mkdir()
    drawn = []
    monkeypatch.setattr(plots, "validation_figure", lambda runs: drawn.append(runs) or plots.pass_at_k_figure([]))
    pipeline.write_plots(SimpleNamespace(dir=tmp_path, arms=[], rows={}))
    assert (tmp_path / "ppo" / "spa" / "val" / "pass_at_k.png").is_file()
    assert (tmp_path / "ppo" / "once" / "val" / "pass_at_k.png").is_file()
    assert not (tmp_path / "ppo" / "unvalidated" / "val").exists()
    [runs] = drawn  # one figure, of the run validated more than once
    assert [(label, [step for step, _ in steps]) for label, steps in runs] == [("spa", [0, 5])]
    assert (tmp_path / "validation.png").is_file()
