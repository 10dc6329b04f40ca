"""`spa view`: one self-contained HTML page about a run or its episodes, to open in a browser.

What it shows depends on what it is given:

* a run directory: its ``table.md`` (pipeline), its training curves (every ``metrics.jsonl`` in it
  or one level down, `plots.curves_figure`) and the Pass@k curves of its eval reports
  (``eval/*.json``), both drawn now and embedded as PNG; and an episode browser over the episodes
  of those reports (each report is an "arm"), or, for a PPO run, of its first and last
  validation (``val/step-N.json``);
* an eval ``report.json``: the browser over its episodes (``report.trajectories.jsonl``);
* a ``trajectories.jsonl`` (`spa generate`, `spa eval`): the browser over its lines, the arm of
  each being the model that played it.

The browser filters by arm, seed and outcome, and shows for every turn the board the model was
shown, its ``<observation>`` beside that true state and its ``<prediction>`` beside the true next
state, each drawn as a grid with the wrong cells marked (`metrics.grid_cells`, the parsing behind
the reports' cell accuracy), the exact-match verdict and the cell accuracy, then the actions
written (and which the game understood), those executed, the reward, the format penalty and the
raw response.

The page is one file: styles, script, data (JSON in a ``<script type="application/json">``) and
images (``data:`` URLs) inline, nothing fetched, no server. Model output is data: the script puts
it into the page as text (``textContent``), never as markup.
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path
from typing import Any

from stages.common import artifacts
from stages.common.errors import UserError
from stages.evaluation import metrics, plots, reports

VIEW_EXPECTS = "a run directory (pipeline, sft or ppo), an eval report.json or a trajectories.jsonl"
#: Grids wider or taller than this are shown as text (a state that is not a board: Countdown, QA).
MAX_GRID = 16


def write_page(source: str | Path, out: str | Path) -> str:
    """Write the page about `source` to `out`; return a one-line summary of what it holds."""
    out = Path(out)
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give an .html file path")
    artifacts.check_writable(out)
    title, sections, episodes = _content(Path(source))
    with artifacts.atomic_write(out) as handle:
        handle.write(page(title, sections, episodes))
    arms = sorted({episode["arm"] for episode in episodes})
    held = f"{len(episodes)} episodes ({', '.join(arms)})" if episodes else "no episodes"
    return f"{out}: {held}{', plots' if sections else ''}; open it in a browser"


def _content(source: Path) -> tuple[str, list[str], list[dict[str, Any]]]:
    """The page's title, its HTML sections above the browser, and its episodes."""
    if not source.exists():
        raise UserError(f"{source} does not exist; spa view expects {VIEW_EXPECTS}")
    if source.is_dir():
        return _run_directory(source)
    text = _text(source)
    data = _json(text)
    if isinstance(data, dict) and data.get("format") == reports.REPORT_FORMAT:
        report = reports.load_report(source)
        return f"eval report {source}", [], _report_episodes(source, report)
    if data is not None and text.strip().count("\n"):  # one JSON document over several lines
        raise UserError(f"{source} is a JSON file but not a spa eval report; spa view expects {VIEW_EXPECTS}")
    return f"trajectories {source}", [], _trajectories(source)


def _text(path: Path) -> str:
    """The file's text ("" when it is not UTF-8: reading it as JSONL says so)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror}") from None


def _json(text: str) -> Any:
    """The text as one JSON document, or None when it is not one (JSONL has a line per document)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _trajectories(path: Path, arm: str | None = None) -> list[dict[str, Any]]:
    """The episodes of a trajectories.jsonl; another kind of file is refused, naming what it is."""
    expects = f"spa view expects {VIEW_EXPECTS}"
    try:
        rows, _ = artifacts.read_jsonl(path, fix=expects)
    except UserError as err:  # a line that is not JSON, a file that is not text
        raise UserError(str(err) if str(err).endswith(expects) else f"{err}; {expects}") from None
    problem = _not_trajectories(rows)
    if problem:
        raise UserError(f"{path} {problem}; spa view expects {VIEW_EXPECTS}")
    return [episode_record(row, arm or str(row.get("model") or path.stem)) for row in rows]


def _not_trajectories(rows: list[dict[str, Any]]) -> str | None:
    """What the rows are when they are not episodes (None when they are)."""
    if not rows:
        return "holds no episodes"
    if plots.metrics_stage(rows):
        return f"is the metrics.jsonl of a {plots.metrics_stage(rows)} run (view its directory, or spa plot it)"
    if all("messages" in row and "turns" not in row for row in rows):
        return "holds SFT rows (spa clean), not episodes"
    for number, row in enumerate(rows, 1):
        turns = row.get("turns")
        if not (isinstance(turns, list) and all(isinstance(t, dict) for t in turns) and "seed" in row):
            return f"is not a trajectories.jsonl (row {number} has no seed and turns)"
    return None


def _report_episodes(path: Path, report: dict[str, Any], arm: str | None = None) -> list[dict[str, Any]]:
    stored = Path(report.get("trajectories") or reports.trajectories_path(path))
    found = next((p for p in (stored, path.parent / stored.name) if p.is_file()), None)
    if found is None:
        raise UserError(f"the episodes of {path} ({stored}) are missing; spa view needs the report's "
                        "trajectories.jsonl beside it")
    return _trajectories(found, arm or path.stem)


def _run_directory(root: Path) -> tuple[str, list[str], list[dict[str, Any]]]:
    sections = []
    table = root / "table.md"
    if table.is_file():
        sections.append(_section("Results", _markdown_table(table.read_text(encoding="utf-8"))))
    try:
        runs = plots.runs_in(root)
    except UserError:
        runs = []
    if runs:
        figure = plots.curves_figure(runs)
        sections.append(_section("Training curves", _image(plots.png_bytes(figure), "training curves")))
    evals = reports.reports_in(root / "eval")
    validations = reports.validation_reports(root)
    first_and_last = validations[:1] + validations[1:][-1:]
    named = [(path, path.stem) for path in evals] + [(path, f"validation {path.stem}") for path in first_and_last]
    loaded = [(path, name, reports.load_report(path)) for path, name in named]
    if loaded:
        figure = plots.pass_at_k_figure([report for _, _, report in loaded], [name for _, name, _ in loaded])
        sections.append(_section("Pass@k", _image(plots.png_bytes(figure), "Pass@k curves")))
    episodes = [episode for path, name, report in loaded for episode in _report_episodes(path, report, name)]
    if not sections and not episodes:
        raise UserError(f"{root} holds no spa run (no table.md, metrics.jsonl or eval reports); spa view expects "
                        f"{VIEW_EXPECTS}")
    return f"run {root}", sections, episodes


# ---- the episodes' data ----------------------------------------------------------------------------


def episode_record(row: dict[str, Any], arm: str) -> dict[str, Any]:
    """What the page shows of one trajectory line."""
    return {
        "id": str(row.get("id", "")), "arm": arm, "seed": row.get("seed"), "sample": row.get("sample"),
        "success": bool(row.get("success")), "reward": row.get("total_reward"),
        "penalty": row.get("format_penalty"),
        "turns": [turn_record(turn) for turn in row["turns"]],
    }


def turn_record(turn: dict[str, Any]) -> dict[str, Any]:
    return {
        "observation": compare_states(turn.get("observation"), turn.get("state")),
        "prediction": compare_states(turn.get("prediction"), turn.get("next_state")),
        "response": turn.get("response"), "actions": turn.get("actions") or [],
        "valid": turn.get("action_valid") or [], "executed": turn.get("executed") or [],
        "reward": turn.get("reward"), "penalty": turn.get("penalty"), "format_ok": turn.get("format_ok"),
        "done": turn.get("done"),
    }


def compare_states(written: str | None, truth: str | None) -> dict[str, Any] | None:
    """A state the model wrote beside the true one: both texts, exact match and cell accuracy as
    the reports count them (`metrics`), and both grids with each cell marked right or wrong
    (None for a state text that is not a small grid)."""
    if not isinstance(truth, str):
        return None
    written = written if isinstance(written, str) else None
    compared: dict[str, Any] = {"written": written, "truth": truth, "exact": None, "cells": None, "grids": None}
    true = metrics.grid_cells(truth)
    ours = metrics.grid_cells(written) if written is not None else None
    if written is not None:
        compared["exact"] = metrics.states_match(written, truth)
        compared["cells"] = metrics.cell_accuracy(written, truth)
    if _small(true) and (not ours or _small(ours)):
        compared["grids"] = {"written": None if ours is None else marked(ours, true),
                             "truth": marked(true, true if ours is None else ours)}
    return compared


def _small(grid: list[list[str]]) -> bool:
    return 0 < len(grid) <= MAX_GRID and max(map(len, grid)) <= MAX_GRID


def marked(grid: list[list[str]], other: list[list[str]]) -> list[list[list[Any]]]:
    """Each cell of `grid` as ``[cell, right]``: right when `other` has the same cell there."""
    return [[[cell, r < len(other) and c < len(other[r]) and other[r][c] == cell] for c, cell in enumerate(row)]
            for r, row in enumerate(grid)]


# ---- the page -------------------------------------------------------------------------------------


def _section(title: str, body: str) -> str:
    return f'<section class="run"><h2>{html.escape(title)}</h2>{body}</section>'


def _image(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _markdown_table(text: str) -> str:
    """A Markdown table (table.md) as an HTML table; other lines as paragraphs."""
    rows = [line.strip().strip("|").split("|") for line in text.splitlines() if line.strip().startswith("|")]
    rows = [[cell.strip() for cell in row] for row in rows if not all(set(c.strip()) <= set("-:") for c in row)]
    if not rows:
        return f"<pre>{html.escape(text)}</pre>"
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows[1:])
    return f'<table class="results"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def page(title: str, sections: list[str], episodes: list[dict[str, Any]]) -> str:
    """The whole HTML document."""
    # No "<" inside the script element at all: "</script>" or "<!--" in a model's output cannot end it.
    data = json.dumps({"episodes": episodes}, ensure_ascii=False).replace("<", "\\u003c")
    browser, script = (_BROWSER, _SCRIPT) if episodes else ('<p class="none">No episodes to show.</p>', "")
    parts = {"title": html.escape(title), "sections": "".join(sections), "browser": browser, "data": data,
             "script": script}
    return re.sub(r"\{\{(\w+)\}\}", lambda match: parts[match.group(1)], _TEMPLATE)  # one pass: data stays data


_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>spa view: {{title}}</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 1.5em 2em; color: #222; background: #fff; }
h1 { font-size: 1.3em; margin: 0.8em 0 0.2em; } h2 { font-size: 1.1em; margin: 1em 0 0.4em; }
.source { color: #555; margin: 0 0 1em; }
section.run img { max-width: 100%; border: 1px solid #ddd; }
table.results { border-collapse: collapse; } table.results td, table.results th { border: 1px solid #ccc; padding: 2px 8px; }
table.results td:not(:first-child) { text-align: right; }
.filters { display: flex; gap: 1.2em; align-items: center; flex-wrap: wrap; margin: 0.5em 0; }
#episode-count { font-weight: 600; }
.browser { display: flex; gap: 1em; align-items: flex-start; }
#episode-list { list-style: none; margin: 0; padding: 0; width: 23em; flex: none; max-height: 85vh; overflow-y: auto;
  border: 1px solid #ddd; }
#episode-list li { padding: 3px 6px; cursor: pointer; border-bottom: 1px solid #eee; white-space: nowrap; }
#episode-list li.current { background: #dde8ff; }
#episode-list li .ok { color: #17701e; } #episode-list li .fail { color: #a11; }
#episode { flex: 1; min-width: 0; }
.turn { border: 1px solid #ddd; border-radius: 4px; padding: 6px 10px; margin-bottom: 10px; }
.turn h3 { margin: 0 0 6px; font-size: 1em; }
.pairs { display: flex; gap: 2em; flex-wrap: wrap; }
.pair h4 { margin: 4px 0; font-size: 0.95em; font-weight: 600; }
.sides { display: flex; gap: 1em; }
.side .label { font-size: 0.85em; color: #555; }
table.grid { border-collapse: collapse; font-family: ui-monospace, monospace; }
table.grid td { width: 1.5em; height: 1.5em; text-align: center; border: 1px solid #ccc; padding: 0; }
table.grid td.wrong { background: #ffb3b3; font-weight: 700; }
pre { background: #f6f6f6; padding: 4px 6px; margin: 2px 0; white-space: pre-wrap; word-break: break-word; }
.verdict { font-size: 0.85em; } .verdict.yes { color: #17701e; } .verdict.no { color: #a11; }
.missing { color: #a11; font-style: italic; }
.facts { margin: 6px 0 2px; } .facts > span { margin-right: 1.2em; }
.invalid { text-decoration: line-through; color: #a11; }
</style>
</head>
<body>
<h1>spa view</h1>
<p class="source">{{title}}</p>
{{sections}}
{{browser}}
<script type="application/json" id="spa-data">{{data}}</script>
<script>{{script}}</script>
</body>
</html>
"""

_BROWSER = """<section id="episodes">
<h2>Episodes</h2>
<div class="filters">
<label>arm <select id="filter-arm"></select></label>
<label>seed <select id="filter-seed"></select></label>
<label>outcome <select id="filter-success"><option value="">all</option><option value="1">solved</option>
<option value="0">not solved</option></select></label>
<span id="episode-count"></span>
</div>
<div class="browser"><ol id="episode-list"></ol><div id="episode"></div></div>
</section>"""

_SCRIPT = r"""
"use strict";
const episodes = JSON.parse(document.getElementById("spa-data").textContent).episodes;
const byId = (id) => document.getElementById(id);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function number(value, digits) {
  return typeof value === "number" ? value.toFixed(digits) : "n/a";
}

function percent(value) {
  return typeof value === "number" ? (100 * value).toFixed(1) + "%" : "n/a";
}

function fillSelect(select, values, label) {
  select.appendChild(el("option", null, "all")).value = "";
  for (const value of values) select.appendChild(el("option", null, label(value))).value = String(value);
}

function grid(cells) {
  const table = el("table", "grid");
  for (const row of cells) {
    const tr = table.insertRow();
    for (const [cell, right] of row) {
      const td = tr.insertCell();
      td.textContent = cell;
      if (!right) td.className = "wrong";
    }
  }
  return table;
}

function stateSide(label, text, cells) {
  const side = el("div", "side");
  side.appendChild(el("div", "label", label));
  if (text === null) side.appendChild(el("div", "missing", "not written"));
  else if (cells && !cells.length) side.appendChild(el("div", "missing", "empty"));
  else if (cells) side.appendChild(grid(cells));
  if (text) {
    const details = el("details");
    details.appendChild(el("summary", null, "text"));
    details.appendChild(el("pre", null, text));
    if (cells) side.appendChild(details); else side.appendChild(el("pre", null, text));
  }
  return side;
}

function statePair(title, compared, truthLabel) {
  const pair = el("div", "pair");
  if (!compared) return pair;
  const verdict = compared.exact === null ? "" :
    (compared.exact ? " exact" : " not exact") + ", cells " + percent(compared.cells);
  const heading = el("h4", null, title);
  if (verdict) heading.appendChild(el("span", "verdict " + (compared.exact ? "yes" : "no"), " (" + verdict.trim() + ")"));
  pair.appendChild(heading);
  const sides = el("div", "sides");
  const grids = compared.grids || {};
  sides.appendChild(stateSide("model", compared.written, grids.written));
  sides.appendChild(stateSide(truthLabel, compared.truth, grids.truth));
  pair.appendChild(sides);
  return pair;
}

function actionsText(turn) {
  const span = el("span", null, "actions: ");
  if (!turn.actions.length) span.appendChild(document.createTextNode("none"));
  turn.actions.forEach((action, i) => {
    if (i) span.appendChild(document.createTextNode(" || "));
    span.appendChild(el("span", turn.valid[i] === false ? "invalid" : null, action));
  });
  return span;
}

function showEpisode(episode) {
  const box = byId("episode");
  box.replaceChildren();
  const outcome = episode.success ? "solved" : "not solved";
  box.appendChild(el("h3", null, episode.arm + " / seed " + episode.seed + " / sample " + episode.sample +
    ": " + outcome + ", reward " + number(episode.reward, 2) + ", format penalty " + number(episode.penalty, 2)));
  episode.turns.forEach((turn, index) => {
    const card = el("div", "turn");
    card.appendChild(el("h3", null, "Turn " + (index + 1) + (turn.format_ok === false ? " (malformed)" : "")));
    const pairs = el("div", "pairs");
    pairs.appendChild(statePair("<observation>", turn.observation, "true state (the board shown)"));
    pairs.appendChild(statePair("<prediction>", turn.prediction, "true next state"));
    card.appendChild(pairs);
    const facts = el("div", "facts");
    facts.appendChild(actionsText(turn));
    facts.appendChild(el("span", null, "executed: " + (turn.executed.length ? turn.executed.join(", ") : "none")));
    facts.appendChild(el("span", null, "reward " + number(turn.reward, 2)));
    facts.appendChild(el("span", null, "penalty " + number(turn.penalty, 2)));
    if (turn.done) facts.appendChild(el("span", null, "episode over"));
    card.appendChild(facts);
    const raw = el("details");
    raw.appendChild(el("summary", null, "response"));
    raw.appendChild(el("pre", null, turn.response));
    card.appendChild(raw);
    box.appendChild(card);
  });
}

function applyFilters() {
  const arm = byId("filter-arm").value, seed = byId("filter-seed").value, success = byId("filter-success").value;
  const shown = episodes.filter((e) => (arm === "" || e.arm === arm) && (seed === "" || String(e.seed) === seed) &&
    (success === "" || String(Number(e.success)) === success));
  byId("episode-count").textContent = shown.length === episodes.length ?
    episodes.length + " episodes" : shown.length + " of " + episodes.length + " episodes";
  const list = byId("episode-list");
  list.replaceChildren();
  shown.forEach((episode, index) => {
    const item = el("li");
    item.appendChild(el("span", episode.success ? "ok" : "fail", episode.success ? "\u2713 " : "\u2717 "));
    item.appendChild(document.createTextNode(episode.arm + "  seed " + episode.seed + "  #" + episode.sample +
      "  reward " + number(episode.reward, 2)));
    item.addEventListener("click", () => {
      for (const other of list.children) other.classList.remove("current");
      item.classList.add("current");
      showEpisode(episode);
    });
    list.appendChild(item);
    if (index === 0) item.click();
  });
  if (!shown.length) byId("episode").replaceChildren(el("p", null, "No episode matches the filters."));
}

fillSelect(byId("filter-arm"), [...new Set(episodes.map((e) => e.arm))].sort(), (arm) => arm);
fillSelect(byId("filter-seed"), [...new Set(episodes.map((e) => e.seed))].sort((a, b) => a - b), (seed) => seed);
for (const id of ["filter-arm", "filter-seed", "filter-success"]) byId(id).addEventListener("change", applyFilters);
applyFilters();
"""
