"""The eval report: what it records, how it is read back, and when two reports may be compared.

A report (``spa eval``'s ``report.json``) holds ``settings`` (everything that produced it),
``metrics``, ``per_seed`` (``seed``, ``n``, ``successes``: enough to recompute every Pass@k) and the
path of its trajectories. Two reports may be compared when their settings differ only in what
played (`COMPARABLE_DESPITE`): the model (and the dtype it computes in: bf16 and fp32 round, and so
sample, differently), and the prompt and render mode it plays with, which is
what the paper's arms differ in (Table 2: Vanilla RL on the raw grid, State Estimation RL with
coordinates, VAGEN with the world-model prompt); the puzzles, samples and sampling must agree, so
the paired differences are over the same puzzles.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envs import TextGameEnv
from stages.agent.backends import backend_dtype
from stages.common import artifacts
from stages.common.config import SPAConfig
from stages.common.errors import UserError
from stages.evaluation import metrics

REPORT_FORMAT = "spa-eval-report"
#: Bumped when the report's layout changes; `compare` reads only this version.
REPORT_VERSION = 1

#: Settings that may differ between reports `compare` puts side by side: what played, and
#: provenance that does not change what is measured.
COMPARABLE_DESPITE = ("model", "dtype", "prompt_mode", "render_mode", "backend", "versions", "spa_version",
                      "sample_seed", "state_ppl")


def trajectories_path(out: str | Path) -> Path:
    """Where the episodes of the report at ``out`` go: ``report.json`` -> ``report.trajectories.jsonl``."""
    return artifacts.sidecar_path(out, "trajectories")


def reports_in(directory: str | Path) -> list[Path]:
    """The eval reports in `directory`, by name (their manifests, ``NAME.json.manifest.json``, aside)."""
    return sorted(p for p in Path(directory).glob("*.json") if not p.name.endswith(artifacts.MANIFEST_NAME))


def validation_reports(ppo_dir: str | Path) -> list[Path]:
    """A PPO run's validation reports, ``val/step-N.json``, by step."""
    return sorted(reports_in(Path(ppo_dir) / "val"), key=lambda p: int(p.stem.removeprefix("step-")))


def report_settings(config: SPAConfig, env: TextGameEnv, n: int, k: int, model: str) -> dict[str, Any]:
    """Everything that decides what an eval measures, as recorded in its report."""
    rollout = config.rollout
    versions = artifacts.package_versions()
    return {
        "model": model,
        "backend": rollout.backend,
        "dtype": backend_dtype(config.model, rollout),
        "env": config.env.name,
        "env_options": dict(config.env.options),
        "render_mode": config.eval.render_mode,
        "prompt_mode": config.eval.prompt_mode,
        "seeds": config.eval.seeds,
        "first_seed": config.eval.first_seed,
        "n": n,
        "k": k,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "max_new_tokens": rollout.max_new_tokens,
        "max_turns": rollout.max_turns,
        "max_actions_per_turn": rollout.max_actions_per_turn,
        "max_actions_per_traj": rollout.max_actions_per_traj or env.max_actions_per_traj,
        "history_window": rollout.history_window,
        "format_penalty": rollout.format_penalty,
        "sample_seed": rollout.sample_seed,
        "state_ppl": config.eval.state_ppl,
        "spa_version": versions.get("spa"),
        "versions": versions,
    }


def load_report(path: str | Path) -> dict:
    """A report written by `run`; anything else (another JSON, another format version) is a UserError."""
    report = artifacts.read_json(path)
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        raise UserError(f"{path} is not a spa eval report (no \"format\": \"{REPORT_FORMAT}\")")
    version = report.get("format_version")
    if version != REPORT_VERSION:
        raise UserError(f"{path} is a report of format version {version}, this spa reads version "
                        f"{REPORT_VERSION}; re-run spa eval to compare it")
    return report


def check_comparable(reports: Sequence[dict], names: Sequence[str]) -> None:
    """Refuse reports whose settings differ in anything but `COMPARABLE_DESPITE`; the error names the
    first setting that differs."""
    first = reports[0]["settings"]
    for report, name in zip(reports[1:], names[1:]):
        settings = report["settings"]
        for key in sorted(set(first) | set(settings)):
            if key in COMPARABLE_DESPITE:
                continue
            if first.get(key) != settings.get(key):
                raise UserError(f"{name} was made with {key}={settings.get(key)!r} but {names[0]} with "
                                f"{key}={first.get(key)!r}; compare runs with the same settings, "
                                "or pass --force")


def compare_rows(paths: Sequence[str | Path], force: bool = False) -> list[dict[str, Any]]:
    """One row of headline figures per report, after checking the reports may be compared."""
    if not paths:
        raise UserError("compare needs at least one report")
    reports = [load_report(path) for path in paths]
    if not force:
        check_comparable(reports, [str(path) for path in paths])
    rows = []
    for path, report in zip(paths, reports):
        settings, figures = report["settings"], report["metrics"]
        wm = figures.get("world_model", {})
        k = settings["k"]
        rows.append({
            "report": str(path),
            "model": settings["model"],
            "env": settings["env"],
            "prompt_mode": settings.get("prompt_mode"),
            "render_mode": settings.get("render_mode"),
            "k": k,
            "pass@1": figures.get("pass@1"),
            "pass@k": figures.get("pass_at_k", {}).get(str(k)),
            # (difference, 2.5%, 97.5%) against the first report; None for it and when not paired
            "pass@1_vs_first": _paired(reports[0], report, 1) if report is not reports[0] else None,
            "pass@k_vs_first": _paired(reports[0], report, k) if report is not reports[0] else None,
            "observation_exact": wm.get("observation", {}).get("exact_match"),
            "prediction_exact": wm.get("prediction", {}).get("exact_match"),
            "prediction_of_change_exact": wm.get("prediction_of_change", {}).get("exact_match"),
            # the two forms of those predictions apart (reports written before them lack them)
            "prediction_of_change_grid_exact": wm.get("prediction_of_change", {}).get("grid_exact"),
            "prediction_of_change_coordinates_exact": wm.get("prediction_of_change", {}).get("coordinates_exact"),
            "observation_cells": wm.get("observation", {}).get("cell_accuracy"),
            "prediction_cells": wm.get("prediction", {}).get("cell_accuracy"),
            "state_ppl_raw": figures.get("state_perplexity", {}).get("raw", {}).get("ppl"),
            "state_ppl_coords": figures.get("state_perplexity", {}).get("coords", {}).get("ppl"),
        })
    return rows


def seed_comparison(first: Sequence[str | Path], second: Sequence[str | Path], force: bool = False) -> dict[str, Any]:
    """B minus A where each side is one or several runs (an arm's RL seeds), for Pass@1 and the
    reports' Pass@k: every run's own figure and its difference from the other side's runs together,
    the pooled difference with its 95% interval (`metrics.pooled_difference`) and the verdict
    (`metrics.seed_verdict`). The reports must be comparable (`check_comparable`) unless `force`."""
    if not first or not second:
        raise UserError("a seed comparison needs at least one report on each side (--a and --b)")
    paths = [*first, *second]
    reports = [load_report(path) for path in paths]
    if not force:
        check_comparable(reports, [str(path) for path in paths])
    per_seed = [report.get("per_seed", []) for report in reports]
    a_runs, b_runs = per_seed[:len(first)], per_seed[len(first):]
    k = min(report["settings"]["k"] for report in reports)
    figures = {}
    for shown in sorted({1, k}):
        runs = []
        for side, path, rows in zip("A" * len(first) + "B" * len(second), paths, per_seed, strict=True):
            against = ([rows], b_runs) if side == "A" else (a_runs, [rows])
            runs.append({"side": side, "report": str(path), "pass": metrics.pass_at_k_curve(rows).get(shown),
                         "difference": metrics.pooled_difference(*against, shown)})
        pooled = metrics.pooled_difference(a_runs, b_runs, shown)
        differences = [run["difference"][0] for run in runs if run["difference"] is not None]
        figures[f"pass@{shown}"] = {"runs": runs, "pooled": pooled, "verdict": metrics.seed_verdict(pooled, differences)}
    return {"a": [str(p) for p in first], "b": [str(p) for p in second], "k": k, "figures": figures}


def _paired(first: dict, other: dict, k: int) -> tuple[float, float, float] | None:
    return metrics.paired_difference(first.get("per_seed", []), other.get("per_seed", []), k)
