"""Eval reports as rich tables: one report, and several side by side like the paper's Table 2."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stages.evaluation import reports


def compare(paths: Sequence[str | Path], force: bool = False):
    """A rich table of several reports side by side, in percent like the paper's Table 2, and a
    second one with each report's Pass@1 and Pass@k minus the first report's, with 95% intervals
    over the puzzles."""
    from rich.console import Group
    from rich.table import Table

    rows = reports.compare_rows(paths, force)
    ks = {row["k"] for row in rows}
    k_header = f"Pass@{ks.pop()}" if len(ks) == 1 else "Pass@k"
    envs_ = sorted({row["env"] for row in rows})
    table = Table(title=f"spa eval: {', '.join(envs_)} (x10^-2, as the paper's tables)")
    headers = ("report", "model", "prompt, states", "Pass@1", k_header, "obs exact", "pred exact", "obs cells",
               "pred cells")
    for header in headers:
        table.add_column(header, justify="left" if header in headers[:3] else "right")
    for row in rows:
        k_cell = _percent(row["pass@k"]) + ("" if k_header != "Pass@k" else f" (k={row['k']})")
        table.add_row(row["report"], row["model"], f"{row['prompt_mode']}, {row['render_mode']}",
                      _percent(row["pass@1"]), k_cell,
                      _percent(row["observation_exact"]), _percent(row["prediction_exact"]),
                      _percent(row["observation_cells"]), _percent(row["prediction_cells"]))
    if len(rows) == 1:
        return table
    differences = Table(title=f"minus {rows[0]['report']} [95% interval, puzzles resampled]")
    for header in ("report", "Pass@1", k_header):
        differences.add_column(header, justify="left" if header == "report" else "right")
    for row in rows[1:]:
        differences.add_row(row["report"], _difference(row["pass@1_vs_first"]), _difference(row["pass@k_vs_first"]))
    return Group(table, differences)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _difference(paired: tuple[float, float, float] | None) -> str:
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
        overall = _table("world model", "tag written (%)", "exact match (%)", "cell accuracy (%)")
        for kind in ("observation", "prediction"):
            row = wm[kind]
            overall.add_row(kind, _percent(row["coverage"]), _percent(row["exact_match"]),
                            _percent(row["cell_accuracy"]))
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
