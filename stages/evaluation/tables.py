"""Eval reports as rich tables: one report, and several side by side like the paper's Table 2."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stages.evaluation import reports


def compare(paths: Sequence[str | Path], force: bool = False):
    """`compare_table` of the reports at `paths` (refused when their settings differ, unless `force`)."""
    return compare_table(reports.compare_rows(paths, force))


def compare_table(rows: Sequence[dict[str, Any]]):
    """A rich table of several reports (`reports.compare_rows`) side by side, in percent like the
    paper's Table 2, and a second one with each report's Pass@1 and Pass@k minus the first
    report's, with 95% intervals over the puzzles. Report and model names are never cut
    (`print_wide`)."""
    from rich.console import Group
    from rich.table import Table

    headers, cells = _compare_cells(rows)
    envs_ = sorted({row["env"] for row in rows})
    table = Table(title=f"spa eval: {', '.join(envs_)} (%, as the paper's tables)")
    for header in headers:
        name = header in ("report", "model", "prompt, states")
        table.add_column(header, justify="left" if name else "right", no_wrap=name)
    for line in cells:
        table.add_row(*line)
    if len(rows) == 1:
        return table
    differences = Table(title=f"minus {rows[0]['report']} [95% interval, puzzles resampled]")
    for header in ("report", "Pass@1", headers[4]):
        differences.add_column(header, justify="left" if header == "report" else "right",
                               no_wrap=header == "report")
    for row in rows[1:]:
        differences.add_row(row["report"], difference(row["pass@1_vs_first"]), difference(row["pass@k_vs_first"]))
    return Group(table, differences)


def _compare_cells(rows: Sequence[dict[str, Any]]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The headers and the cells (percent) of the side-by-side table."""
    ks = {row["k"] for row in rows}
    k_header = f"Pass@{next(iter(ks))}" if len(ks) == 1 else "Pass@k"
    headers = ("report", "model", "prompt, states", "Pass@1", k_header, "obs exact", "pred exact",
               "pred exact, changed", "changed: grid / coords", "obs cells", "pred cells")
    cells = []
    for row in rows:
        k_cell = _percent(row["pass@k"]) + ("" if k_header != "Pass@k" else f" (k={row['k']})")
        cells.append((row["report"], row["model"], f"{row['prompt_mode']}, {row['render_mode']}",
                      _percent(row["pass@1"]), k_cell,
                      _percent(row["observation_exact"]), _percent(row["prediction_exact"]),
                      _percent(row["prediction_of_change_exact"]), forms(row),
                      _percent(row["observation_cells"]), _percent(row["prediction_cells"])))
    return headers, cells


def compare_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The side-by-side table as Markdown (percent), with the differences to the first report as
    two more columns (``+1.5 [-2.0, +5.1]``)."""
    headers, cells = _compare_cells(rows)
    headers += (f"Pass@1 minus {rows[0]['report']}", f"{headers[4]} minus {rows[0]['report']}")
    cells = [line + (difference(row["pass@1_vs_first"]), difference(row["pass@k_vs_first"]))
             for line, row in zip(cells, rows)]
    return markdown_table(headers, cells)


def seed_cells(comparison: dict[str, Any]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The headers and cells (percent) of a `reports.seed_comparison`: a line per run with its
    Pass@k and B minus A for it (a B run against every A run, an A run against every B run), then
    the pooled difference and the verdict."""
    figures = comparison["figures"]
    headers = ("side", "report")
    for name in figures:
        headers += (name.replace("pass", "Pass"), f"B minus A, {name.replace('pass', 'Pass')} [95%]")
    runs = zip(*(figure["runs"] for figure in figures.values()))
    cells = [(line[0]["side"], line[0]["report"],
              *(cell for run in line for cell in (_percent(run["pass"]), difference(run["difference"]))))
             for line in runs]
    cells.append(("A, B", "pooled", *(cell for figure in figures.values() for cell in ("", difference(figure["pooled"])))))
    cells.append(("", "verdict: B is", *(cell for figure in figures.values() for cell in ("", figure["verdict"]))))
    return headers, cells


def markdown_table(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """A Markdown table; `|` inside a cell is escaped."""
    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"

    return "\n".join([line(headers), "|" + "---|" * len(headers), *map(line, cells)]) + "\n"


def print_wide(renderable: Any, console: Any) -> None:
    """Print a table on a rich `console` without cutting its no-wrap columns (names): into a file or
    a pipe (where rich would assume 80 columns) at its full width, one line a row; on a terminal at
    least as wide as those columns need, the other columns wrapping to fit."""
    from rich.console import Console
    from rich.measure import Measurement

    needed = Measurement.get(console, console.options.update_width(100_000), renderable)
    width = max(console.width, needed.minimum) if console.is_terminal else needed.maximum
    if width != console.width:
        console = Console(file=console.file, width=width, force_terminal=console.is_terminal,
                          no_color=console.no_color)
    console.print(renderable, highlight=False)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def forms(row: dict[str, Any]) -> str:
    """The exact predictions of moved states in each form, grid / coordinates (percent), of a
    `reports.compare_rows` row."""
    return (f"{_percent(row.get('prediction_of_change_grid_exact'))} / "
            f"{_percent(row.get('prediction_of_change_coordinates_exact'))}")


def difference(paired: tuple[float, float, float] | None) -> str:
    """A paired difference and its interval in percent points: ``+1.5 [-2.0, +5.1]``."""
    if paired is None:
        return "-"
    diff, low, high = (100 * value for value in paired)
    return f"{diff:+.1f} [{low:+.1f}, {high:+.1f}]"


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _shown_ks(n: int, k: int) -> list[int]:
    """Every k up to 16; beyond, the powers of two plus k and n."""
    if n <= 16:
        return list(range(1, n + 1))
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {k, n})


def _table(first: str, *numeric: str):
    """A table whose first column is a label and whose other columns are right-aligned figures."""
    from rich.table import Table

    table = Table()
    table.add_column(first)
    for header in numeric:
        table.add_column(header, justify="right")
    return table


def report_renderable(report: dict):
    """The report as rich tables: Pass@k, episode figures, world-model accuracy, state perplexity."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    settings, figures = report["settings"], report["metrics"]
    title = (f"{settings['model']} on {settings['env']} "
             f"({settings['render_mode']}, {settings['prompt_mode']} prompt): "
             f"{settings['seeds']} seeds x {settings['n']} samples, T={settings['temperature']}, "
             f"top-p {settings['top_p']}, {settings['max_new_tokens']} tokens/turn")
    parts: list[Any] = []

    parts.append(Text(title, style="bold"))
    passk = Table()
    passk.add_column("k", justify="right")
    passk.add_column("Pass@k (%)", justify="right")
    curve = figures.get("pass_at_k", {})
    for k in _shown_ks(settings["n"], settings["k"]):
        passk.add_row(f"{k} *" if k == settings["k"] else str(k), _percent(curve.get(str(k))))
    parts.append(passk)

    episodes = Table(show_header=False)
    episodes.add_column("figure")
    episodes.add_column("value", justify="right")
    for label, key, fmt in (
        ("episodes", "episodes", str),
        ("success rate (Pass@1, %)", "success_rate", _percent),
        ("mean reward (format penalty included)", "mean_reward", _number),
        ("mean format penalty", "mean_format_penalty", _number),
        ("mean turns", "mean_turns", _number),
        ("mean actions executed", "mean_actions", _number),
        ("action validity (%)", "action_validity", _percent),
        ("action effectiveness (%)", "action_effectiveness", _percent),
        ("format-valid turns (%)", "format_valid_rate", _percent),
    ):
        episodes.add_row(label, fmt(figures.get(key)))
    parts.append(episodes)

    wm = figures.get("world_model")
    if wm and any(wm[kind]["turns"] for kind in ("observation", "prediction")):
        overall = _table("world model", "tag written (%)", "exact match (%)", "cell accuracy (%)",
                         "grid exact (%)", "coordinates exact (%)")
        for label, kind in (("observation", "observation"), ("prediction", "prediction"),
                            ("prediction, state changed", "prediction_of_change")):
            row = wm.get(kind)  # reports written before prediction_of_change existed lack it
            if row:
                overall.add_row(label, _percent(row["coverage"]), _percent(row["exact_match"]),
                                _percent(row["cell_accuracy"]), _percent(row.get("grid_exact")),
                                _percent(row.get("coordinates_exact")))
        parts.append(overall)
        per_turn = _table("turn", "episodes", "obs exact", "pred exact", "obs cells", "pred cells")
        per_turn.title, per_turn.title_justify = "by turn (%)", "left"
        for row in wm["per_turn"]:
            obs, pred = row["observation"], row["prediction"]
            per_turn.add_row(str(row["turn"]), str(row["turns"]), _percent(obs["exact_match"]),
                             _percent(pred["exact_match"]), _percent(obs["cell_accuracy"]),
                             _percent(pred["cell_accuracy"]))
        parts.append(per_turn)

    ppl = figures.get("state_perplexity")
    if ppl:
        table = _table("state perplexity", "PPL", "NLL/token", "tokens", "states")
        for label, view in (("raw grid", "raw"), ("grid + coordinates", "coords")):
            row = ppl[view]
            table.add_row(label, _number(row["ppl"]), _number(row["nll"], 3), str(row["tokens"]),
                          str(row["states"]))
        parts.append(table)
    if report.get("trajectories"):
        parts.append(Text(f"episodes: {report['trajectories']}"))
    return Group(*parts)


def print_report(report: dict, console: Any = None) -> None:
    """The report's tables on `console` (a rich Console; default: stdout)."""
    from rich.console import Console

    (console or Console()).print(report_renderable(report), highlight=False)
