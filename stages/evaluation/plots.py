"""Plots, drawn with matplotlib into PNG files: the training curves of `spa sft` and `spa ppo` runs
(`spa plot`, the pipeline's ``curves.png``) and the Pass@k curves of eval reports with their
bootstrap bands (`spa eval --plot`, `spa eval compare --plot`, the pipeline's ``pass_at_k.png``).

Training curves come from the runs' ``metrics.jsonl``, one panel per figure and one line per run
in every panel where the run has that figure, in the same colour everywhere, with one legend:

* sft: training loss, validation loss (at the end of each epoch), learning rate;
* ppo: reward, success, validation Pass@1 and Pass@k (step 0 is the model before training), KL
  between the updated and the rollout policy (``ppo_kl``) and to the reference (``kl_ref``, when
  ``ppo.kl_coef > 0``), entropy, clip fraction, response length, the collapse diagnostics
  (`stages.evaluation.collapse`): distinct responses in a group, repeated 4-grams, input dependence,
  and the rollouts' world-model accuracy: the share of exact observations, of exact predictions, and
  of exact predictions on the turns that changed the state (a step where no turn wrote the tag has
  no point).

`validation_figure` draws the validation Pass@1 of PPO runs against their step, each point with its
95% bootstrap band over the eval puzzles (the pipeline's ``validation.png``).

Rates are drawn in percent, as every table of spa prints them. A run with one point in a panel
(a one-step PPO run's reward, say) draws no curve there: its figures are written under the panels.
"""

from __future__ import annotations

import io
import math
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.common import artifacts
from stages.common.errors import UserError
from stages.evaluation import metrics

PLOT_NEEDS_MATPLOTLIB = "plots need matplotlib, which spa installs; pip install matplotlib"
METRICS_FILE = "metrics.jsonl"
#: Inches per panel of the training curves and the resolution of every PNG.
PANEL_SIZE, COLUMNS, DPI = (4.8, 3.4), 3, 100
#: What `spa plot` reads, for the message that refuses anything else.
PLOT_EXPECTS = "the directory of a spa sft, ppo or pipeline run, or a run's metrics.jsonl"


def check_plot(path: str | Path, flag: str = "--plot") -> None:
    """Refuse a plot that could not be drawn (no matplotlib, a path that cannot be written)."""
    _pyplot()
    if Path(path).is_dir():
        raise UserError(f"{flag} {path} is a directory; give a .png file path")
    artifacts.check_writable(path)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError(PLOT_NEEDS_MATPLOTLIB) from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def save_png(figure: Any, path: str | Path) -> Path:
    """Write `figure` as a PNG (atomically) and close it."""
    from matplotlib import pyplot

    try:
        with artifacts.atomic_write(path, "wb") as handle:
            figure.savefig(handle, format="png", dpi=DPI)
    finally:
        pyplot.close(figure)
    return Path(path)


def png_bytes(figure: Any) -> bytes:
    """`figure` as PNG bytes (for pages that embed it), closed afterwards."""
    from matplotlib import pyplot

    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, format="png", dpi=DPI)
    finally:
        pyplot.close(figure)
    return buffer.getvalue()


# ---- training curves ------------------------------------------------------------------------------


@dataclass
class Run:
    """The metrics of one training run: its label in legends, its stage and its rows."""

    label: str
    stage: str  # "sft" or "ppo"
    rows: list[dict[str, Any]]


@dataclass(frozen=True)
class Panel:
    title: str
    stage: str
    value: Callable[[dict[str, Any]], float | None]
    percent: bool = False
    log_y: bool = False


def _key(name: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda row: row.get(name)


def _val_pass_at_k(row: dict[str, Any]) -> float | None:
    """The row's validation Pass@k for its largest k > 1 (ppo logs ``val_pass@{eval.pass_k}``)."""
    ks = [int(match.group(1)) for key in row if (match := re.fullmatch(r"val_pass@(\d+)", key))]
    ks = [k for k in ks if k > 1]
    return row.get(f"val_pass@{max(ks)}") if ks else None


PANELS = (
    Panel("training loss", "sft", _key("loss")),
    Panel("validation loss", "sft", _key("val_loss")),
    Panel("learning rate", "sft", _key("lr"), log_y=True),
    Panel("reward", "ppo", _key("reward")),
    Panel("success (%)", "ppo", _key("success"), percent=True),
    Panel("validation Pass@1 (%)", "ppo", _key("val_pass@1"), percent=True),
    Panel("validation Pass@k (%)", "ppo", _val_pass_at_k, percent=True),
    Panel("KL, updated vs rollout policy", "ppo", _key("ppo_kl")),
    Panel("KL to the reference", "ppo", _key("kl_ref")),
    Panel("entropy", "ppo", _key("entropy")),
    Panel("clip fraction (%)", "ppo", _key("clip_frac"), percent=True),
    Panel("response length (tokens)", "ppo", _key("response_length")),
    Panel("distinct responses in a group (%)", "ppo", _key("distinct_in_group"), percent=True),
    Panel("repeated 4-grams (%)", "ppo", _key("repeated_ngrams"), percent=True),
    Panel("input dependence", "ppo", _key("input_dependence")),
    Panel("exact observations (%)", "ppo", _key("wm_observation_exact"), percent=True),
    Panel("exact predictions (%)", "ppo", _key("wm_prediction_exact"), percent=True),
    Panel("exact predictions, state changed (%)", "ppo", _key("wm_prediction_of_change_exact"), percent=True),
)


def metrics_stage(rows: list[dict[str, Any]]) -> str | None:
    """"sft" or "ppo" for the rows of a metrics.jsonl of that stage, else None."""
    if not rows or not all(isinstance(row.get("step"), int) for row in rows):
        return None
    if all("loss" in row and "lr" in row for row in rows):
        return "sft"
    if any("reward" in row for row in rows) or all("val_pass@1" in row for row in rows):
        return "ppo"
    return None


def read_run(path: str | Path, label: str | None = None) -> Run:
    """The run whose metrics are the file `path`; anything else is a UserError naming what
    `spa plot` expects."""
    path = Path(path)
    try:
        rows, _ = artifacts.read_jsonl(path, skip_bad=True)
    except UserError:
        rows = []
    stage = metrics_stage(rows)
    if stage is None:
        raise UserError(f"{path} is not the metrics.jsonl of a spa sft or ppo run; spa plot expects {PLOT_EXPECTS}")
    return Run(label or str(path.parent if path.name == METRICS_FILE else path), stage, rows)


def read_runs(paths: Sequence[str | Path]) -> list[Run]:
    """The runs at `paths` (`runs_in`), each labelled by the path as given."""
    runs = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise UserError(f"{path} does not exist; spa plot expects {PLOT_EXPECTS}")
        runs += [read_run(path)] if path.is_file() else runs_in(path, str(given))
    return runs


def runs_in(directory: str | Path, label: str = "") -> list[Run]:
    """The run of a run directory (its metrics.jsonl), or the runs one or two levels below it (a
    pipeline run: sft/ID/, ppo/ID/), labelled ``label/PATH`` (``PATH`` without a label, e.g.
    ``ppo/spa``)."""
    directory = Path(directory)
    if (directory / METRICS_FILE).is_file():
        return [read_run(directory / METRICS_FILE, label or directory.name)]
    found = sorted([*directory.glob(f"*/{METRICS_FILE}"), *directory.glob(f"*/*/{METRICS_FILE}")])
    if not found:
        raise UserError(f"{directory} holds no {METRICS_FILE}, nor do its sub-directories; spa plot expects "
                        f"{PLOT_EXPECTS}")
    names = [path.parent.relative_to(directory).as_posix() for path in found]
    return [read_run(path, f"{label}/{name}" if label else name) for path, name in zip(found, names)]


def curves_figure(runs: Sequence[Run]) -> Any:
    """The training curves of `runs` as a matplotlib figure (see the module docstring): one panel
    per figure some run has, `COLUMNS` panels a row of `PANEL_SIZE` inches each."""
    pyplot = _pyplot()
    from matplotlib.ticker import MaxNLocator

    drawn = []
    single: dict[str, list[str]] = {}  # run label -> its figures at its one point, written, not drawn
    for panel in PANELS:
        lines = []
        for index, run in enumerate(runs):
            if run.stage != panel.stage:
                continue
            points = [(row["step"], value) for row in run.rows
                      if isinstance(value := panel.value(row), (int, float)) and math.isfinite(value)]
            if len(points) == 1:  # one point is no curve: a dot on an axis would read as one
                step, value = points[0]
                shown = f"{100 * value:.1f}" if panel.percent else f"{value:.3g}"
                single.setdefault(run.label, []).append(f"{panel.title} {shown} (step {step})")
            elif points:
                lines.append((index, run.label, points))
        if lines:
            drawn.append((panel, lines))
    if not drawn and not single:
        raise UserError("the runs have no figure to plot yet (their metrics.jsonl hold no step)")
    rows = max(1, math.ceil(len(drawn) / COLUMNS))
    figure, axes = pyplot.subplots(rows, COLUMNS, squeeze=False, layout="constrained",
                                   figsize=(COLUMNS * PANEL_SIZE[0], rows * PANEL_SIZE[1]))
    if single:
        notes = [f"{label}, one point each: " + "; ".join(figures) for label, figures in single.items()]
        figure.supxlabel("\n".join(textwrap.fill(note, 150) for note in notes), fontsize="small")
    handles: dict[int, Any] = {}  # run index -> its line, for the legend
    for ax, (panel, lines) in zip(axes.flat, drawn):
        for index, label, points in lines:
            steps, values = zip(*points)
            values = [100 * v for v in values] if panel.percent else list(values)
            (line,) = ax.plot(steps, values, color=f"C{index % 10}", label=label,
                              marker="o" if len(points) < 30 else None, markersize=3)
            handles.setdefault(index, line)
        ax.set_title(panel.title, fontsize="medium")
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if panel.log_y and all(v > 0 for _, _, points in lines for _, v in points):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    ordered = [handles[index] for index in sorted(handles)]
    if ordered:
        figure.legend(ordered, [line.get_label() for line in ordered], loc="outside upper center",
                      ncol=min(len(ordered), 4), fontsize="small")
    return figure


def plot_curves(runs: Sequence[Run], path: str | Path) -> Path:
    """Draw the training curves of `runs` into the PNG `path`."""
    return save_png(curves_figure(runs), path)


def read_validations(ppo_dirs: Sequence[str | Path],
                     labels: Sequence[str] | None = None) -> list[tuple[str, list[tuple[int, dict]]]]:
    """The validation reports (``val/step-N.json``, by step) of those of the PPO run directories
    `ppo_dirs` that have some, as `validation_figure` takes them, labelled by `labels` (default the paths)."""
    from stages.evaluation.reports import load_report, validation_reports

    runs = []
    for index, directory in enumerate(ppo_dirs):
        if steps := validation_reports(directory) if Path(directory).is_dir() else []:
            label = labels[index] if labels else str(directory)
            runs.append((label, [(int(path.stem.removeprefix("step-")), load_report(path)) for path in steps]))
    return runs


def validation_figure(runs: Sequence[tuple[str, Sequence[tuple[int, dict]]]]) -> Any:
    """Validation Pass@1 against PPO step, one line per run (``(label, [(step, eval report)])``),
    with the 95% band of each point from resampling the eval puzzles (`metrics.pass_at_k_band`)."""
    from matplotlib.ticker import MaxNLocator

    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(6, 4), layout="constrained")
    for index, (label, reports) in enumerate(runs):
        points = sorted((step, metrics.pass_at_k_band(report["per_seed"])[1]) for step, report in reports)
        steps = [step for step, _ in points]
        value, low, high = ([100 * band[i] for _, band in points] for i in range(3))
        axes.plot(steps, value, marker="o", markersize=3, color=f"C{index % 10}", label=label)
        axes.fill_between(steps, low, high, color=f"C{index % 10}", alpha=0.15, linewidth=0)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    envs_ = sorted({report["settings"]["env"] for _, reports in runs for _, report in reports})
    axes.set(xlabel="PPO step", ylabel="validation Pass@1 (%)",
             title=f"Validation Pass@1 on {', '.join(envs_)} (bands: 95%, puzzles resampled)")
    axes.title.set_fontsize("medium")
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize="small")
    return figure


# ---- Pass@k ----------------------------------------------------------------------------------------


#: Reports whose legend fits inside the Pass@k axes without hiding the lines.
LEGEND_INSIDE_AT_MOST = 6


def pass_at_k_figure(reports: dict | Sequence[dict], names: Sequence[str] | None = None) -> Any:
    """Pass@k against k, one line per report (labelled by `names`, default the model), with its
    95% bootstrap band over the puzzles (`metrics.pass_at_k_band`)."""
    from matplotlib.ticker import MaxNLocator

    pyplot = _pyplot()
    reports = [reports] if isinstance(reports, dict) else list(reports)
    crowded = len(reports) > LEGEND_INSIDE_AT_MOST  # the legend would hide the lines: put it beside them
    figure, axes = pyplot.subplots(figsize=(9, 4) if crowded else (6, 4), layout="constrained")
    palette = pyplot.get_cmap("tab20") if len(reports) > 10 else None  # more lines than the default 10 colors
    largest = 1
    for index, report in enumerate(reports):
        settings = report["settings"]
        label = names[index] if names else f"{settings['model']} (T={settings['temperature']})"
        band = metrics.pass_at_k_band(report.get("per_seed") or [])
        if band:
            ks = sorted(band)
            values, low, high = ([100 * band[k][i] for k in ks] for i in range(3))
        else:  # a report without per-seed counts: its curve alone
            curve = sorted((int(k), v) for k, v in report["metrics"]["pass_at_k"].items())
            if not curve:
                continue
            ks, values = [k for k, _ in curve], [100 * v for _, v in curve]
            low = high = None
        largest = max(largest, ks[-1])
        color = palette(index % 20) if palette else f"C{index}"
        axes.plot(ks, values, marker="o", markersize=3, color=color, label=label)
        if low is not None:
            axes.fill_between(ks, low, high, color=color, alpha=0.15, linewidth=0)
    if largest > 16:
        axes.set_xscale("log", base=2)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    envs_ = sorted({report["settings"]["env"] for report in reports})
    axes.set(xlabel="k (samples per puzzle)", ylabel="Pass@k (%)", ylim=(0, 100),
             title=f"Pass@k on {', '.join(envs_)} (bands: 95%, puzzles resampled)")
    axes.title.set_fontsize("medium")
    axes.grid(alpha=0.3)
    if crowded:
        axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")
    else:
        axes.legend(loc="lower right", fontsize="small")
    return figure


def plot_pass_at_k(reports: dict | Sequence[dict], path: str | Path, names: Sequence[str] | None = None) -> Path:
    """Draw `pass_at_k_figure` into the PNG `path`."""
    return save_png(pass_at_k_figure(reports, names), path)
