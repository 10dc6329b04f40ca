"""`spa pipeline`: the whole SPA recipe in one run directory, resumable and incremental.

Stages, in order, each writing under `pipeline.dir`:

    generate     trajectories.jsonl   self-play data: `pipeline.data_groups` puzzles x
                                      `rollout.group_size` episodes (`pipeline.data_policy`: the
                                      model, or random actions = the paper's RandSFT bootstrap)
    clean        sft.jsonl (+ .val)   ground-truth states
    sft          sft/                 world-model fine-tuning from `model.name`
    ppo          ppo/                 PPO from sft/final: SPA
    ppo_vanilla  ppo_vanilla/         PPO from `model.name` (`pipeline.vanilla_ppo`: the paper's
                                      "Vanilla RL" baseline, same PPO settings)
    eval_*       eval/NAME.json       the same eval settings for every model: base (with
                                      `pipeline.baselines`), vanilla_ppo, sft, spa
                 table.md             the comparison, like the paper's Table 2
                 curves.png           the training curves of sft/ and ppo*/ (`spa plot`)
                 pass_at_k.png        the Pass@k curves of the evaluated models, with 95% bands

A stage is skipped when it completed before with the same fingerprint: the config sections it
reads plus the hashes of its inputs (`pipeline_state.json` records them). A stage that started
but did not finish is resumed (every stage resumes on its own); one whose settings or inputs
changed since is started over (its old output is removed first). Later stages see the new inputs'
hashes, so they rerun too.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stages.common import artifacts, tracking
from stages.common.config import SPAConfig
from stages.common.console import Console

STATE_FILE = "pipeline_state.json"


class Layout:
    """Where each artifact of a run directory lives."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.trajectories = self.root / "trajectories.jsonl"
        self.sft_data = self.root / "sft.jsonl"
        self.sft = self.root / "sft"
        self.ppo = self.root / "ppo"
        self.ppo_vanilla = self.root / "ppo_vanilla"
        self.eval = self.root / "eval"
        self.table = self.root / "table.md"
        self.curves = self.root / "curves.png"
        self.pass_at_k = self.root / "pass_at_k.png"

    def report(self, name: str) -> Path:
        return self.eval / f"{name}.json"


def stage_configs(config: SPAConfig) -> dict[str, SPAConfig]:
    """The config of every stage of the run: paths inside the run dir, models chained."""
    run = Layout(config.pipeline.dir)
    configs: dict[str, SPAConfig] = {}
    config = copy.deepcopy(config)
    for section in (config.generate, config.sft, config.ppo, config.eval):
        section.resume = False  # the pipeline decides what is resumed (`run`)

    generate = copy.deepcopy(config)
    generate.rollout.groups = config.pipeline.data_groups
    if config.pipeline.data_policy == "random":
        generate.rollout.backend = "random"
    generate.generate.out = str(run.trajectories)
    configs["generate"] = generate

    clean = copy.deepcopy(config)
    clean.clean.data, clean.clean.out = str(run.trajectories), str(run.sft_data)
    configs["clean"] = clean

    sft = copy.deepcopy(config)
    sft.sft.data, sft.sft.val_data, sft.sft.out = str(run.sft_data), "", str(run.sft)
    configs["sft"] = sft

    ppo = copy.deepcopy(config)
    ppo.model.name, ppo.ppo.out = str(run.sft / "final"), str(run.ppo)
    configs["ppo"] = ppo
    if config.pipeline.vanilla_ppo:
        vanilla = copy.deepcopy(config)
        vanilla.ppo.out = str(run.ppo_vanilla)
        configs["ppo_vanilla"] = vanilla

    for name, model in evaluated_models(config).items():
        evaluation = copy.deepcopy(config)
        evaluation.model.name, evaluation.eval.out = str(model), str(run.report(name))
        configs[f"eval_{name}"] = evaluation
    return configs


def evaluated_models(config: SPAConfig) -> dict[str, str]:
    """Eval name -> model, in the order of the paper's tables."""
    run = Layout(config.pipeline.dir)
    models = {"base": config.model.name} if config.pipeline.baselines else {}
    if config.pipeline.vanilla_ppo:
        models["vanilla_ppo"] = str(run.ppo_vanilla / "final")
    return {**models, "sft": str(run.sft / "final"), "spa": str(run.ppo / "final")}


#: What the table calls each evaluated model.
LABELS = {"base": "base model", "vanilla_ppo": "+ vanilla PPO", "sft": "+ SPA world-model SFT",
          "spa": "+ SPA (SFT, then PPO)"}

#: The config sections each stage reads (its fingerprint); eval stages read `EVAL_SECTIONS`.
SECTIONS = {
    "generate": ("env", "model", "rollout", "generate"),
    "clean": ("clean",),
    "sft": ("model", "sft"),
    "ppo": ("env", "model", "rollout", "ppo"),
    "ppo_vanilla": ("env", "model", "rollout", "ppo"),
}
EVAL_SECTIONS = ("env", "model", "rollout", "eval")


def stage_inputs(name: str, config: SPAConfig) -> list[Path]:
    """The files a stage reads; their hashes are part of its fingerprint."""
    if name == "clean":
        return [Path(config.clean.data)]
    if name == "sft":
        return [Path(config.sft.data), artifacts.val_path(config.sft.data)]
    if name.startswith(("ppo", "eval_")):
        model = Path(config.model.name)
        return sorted(model.glob("*.safetensors")) if model.is_dir() else []
    return []


def fingerprint(name: str, config: SPAConfig) -> str:
    data = asdict(config)
    sections = EVAL_SECTIONS if name.startswith("eval_") else SECTIONS[name]
    content = {
        "config": {section: data[section] for section in sections},
        "inputs": {str(p): artifacts.file_sha256(p) for p in stage_inputs(name, config) if p.is_file()},
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def stage_outputs(name: str, config: SPAConfig) -> list[Path]:
    if name == "generate":
        out = Path(config.generate.out)
        return [out, out.with_name(out.name + ".manifest.json")]
    if name == "clean":
        out = Path(config.clean.out)
        return [out, artifacts.val_path(out), out.with_name(out.name + ".manifest.json")]
    if name == "sft":
        return [Path(config.sft.out)]
    if name.startswith("ppo"):
        return [Path(config.ppo.out)]
    out = Path(config.eval.out)
    return [out, *out.parent.glob(f"{out.stem}.*")]


def run(config: SPAConfig) -> dict[str, Any]:
    """Run (or continue) every stage; return the comparison rows and what was skipped."""
    console = Console(config.quiet)
    tracking.check(config.tracking)  # before the first stage, not when sft starts
    run_dir = Layout(config.pipeline.dir)
    artifacts.check_writable(run_dir.root)
    run_dir.root.mkdir(parents=True, exist_ok=True)
    state_path = run_dir.root / STATE_FILE
    state = artifacts.read_json(state_path) if state_path.is_file() else {}
    skipped = []
    for name, stage_config in stage_configs(config).items():
        key = fingerprint(name, stage_config)
        recorded = state.get(name, {})
        if recorded.get("fingerprint") == key and recorded.get("complete"):
            console.result(f"[pipeline] {name}: complete, skipped")
            skipped.append(name)
            continue
        resume = recorded.get("fingerprint") == key  # started with the same settings: continue it
        if not resume:
            _remove(stage_outputs(name, stage_config))
        console.result(f"[pipeline] {name}: {'resuming' if resume else 'running'}")
        state[name] = {"fingerprint": key, "complete": False}
        artifacts.write_json(state_path, state)
        _runner(name)(stage_config, resume, console)
        _release_memory()
        state[name]["complete"] = True
        artifacts.write_json(state_path, state)
    table = _write_table(config, run_dir)
    console.result(table)
    _write_plots(config, run_dir)
    return {"dir": str(run_dir.root), "skipped": skipped, "table": table}


def _runner(name: str) -> Callable[[SPAConfig, bool, Console], Any]:
    """The stage's run, continuing its earlier output when `resume` (every stage can)."""
    from stages import clean, evaluate, generate, ppo, sft
    from stages.evaluation.tables import print_report

    def run_eval(cfg: SPAConfig, resume: bool, console: Console) -> Any:
        cfg.eval.resume = resume
        report = evaluate.run(cfg)
        if not cfg.quiet:
            print_report(report)
        return report

    def resumed(stage: Any, section: str) -> Callable[[SPAConfig, bool, Console], Any]:
        def run_stage(cfg: SPAConfig, resume: bool, console: Console) -> Any:
            getattr(cfg, section).resume = resume
            return stage.run(cfg)
        return run_stage

    runners = {"generate": resumed(generate, "generate"), "clean": lambda cfg, _, __: clean.run(cfg),
               "sft": resumed(sft, "sft"), "ppo": resumed(ppo, "ppo"), "ppo_vanilla": resumed(ppo, "ppo")}
    return runners.get(name, run_eval)


def _release_memory() -> None:
    """Free what the finished stage held (its models, a vLLM engine's GPU memory) before the next
    stage loads its own: the stages run in this one process."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _remove(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _write_table(config: SPAConfig, run_dir: Layout) -> str:
    """A Markdown table of the eval reports, like the paper's Table 2: percentages and,
    when measured (`eval.state_ppl`), the state perplexity with coordinates."""
    from stages.evaluation.reports import compare_rows

    names = [name for name in evaluated_models(config) if run_dir.report(name).is_file()]
    rows = compare_rows([run_dir.report(name) for name in names]) if names else []
    k = rows[0]["k"] if rows else config.eval.pass_k
    with_ppl = any(row["state_ppl_coords"] is not None for row in rows)
    header = f"| {config.env.name} | Pass@1 | Pass@{k} | observation exact | prediction exact | prediction cells |"
    lines = [header + (" state PPL |" if with_ppl else ""), "|---" * (6 + with_ppl) + "|"]
    for name, row in zip(names, rows):
        figures = [_percent(row[key]) for key in ("pass@1", "pass@k", "observation_exact", "prediction_exact",
                                                  "prediction_cells")]
        if with_ppl:
            figures.append("n/a" if row["state_ppl_coords"] is None else f"{row['state_ppl_coords']:.2f}")
        lines.append(f"| {LABELS[name]} | " + " | ".join(figures) + " |")
    table = "\n".join(lines) + "\n"
    with artifacts.atomic_write(run_dir.table) as handle:
        handle.write(table)
    return table


def _write_plots(config: SPAConfig, run_dir: Layout) -> None:
    """curves.png from the training runs' metrics, pass_at_k.png from the eval reports."""
    from stages.evaluation import plots
    from stages.evaluation.reports import load_report

    plots.plot_curves(plots.runs_in(run_dir.root), run_dir.curves)
    names = [name for name in evaluated_models(config) if run_dir.report(name).is_file()]
    if names:
        plots.plot_pass_at_k([load_report(run_dir.report(name)) for name in names], run_dir.pass_at_k,
                             [LABELS.get(name, name) for name in names])


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"
