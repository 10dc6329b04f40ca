"""Experiment trackers beside `metrics.jsonl`: TRL's `report_to` for `spa sft` and `spa ppo`.

``tracking.report_to`` is ``["none"]`` (the default) or any of:

* ``tensorboard``: event files in ``OUT/tensorboard/`` (``tensorboard --logdir OUT``), written with
  torch's `SummaryWriter`;
* ``wandb``: a Weights & Biases run in ``OUT/wandb/``, offline by default (``tracking.wandb_mode``):
  nothing leaves the machine, one line says where the run was saved and ``wandb sync`` uploads it
  later.

Each tracker gets the same figures as the `metrics.jsonl` row of every step (the numbers of the
row under the row's own names, at the row's ``step``) and the resolved run config (a YAML text in
TensorBoard, the run's config in wandb). A figure the step could not define (null in the row, such as
the exact share of predictions when no rollout turn wrote one) is left out of that step: its curve
has no point there rather than a 0. The packages are optional extras imported only when
named; `check` refuses a tracker that is not installed before any work starts. Only the process
that writes `metrics.jsonl` (rank 0) opens the trackers.

A resumed run continues the same TensorBoard directory; the events of the steps it logs again are
purged (`SummaryWriter`'s ``purge_step``). A wandb run cannot be continued offline, so a resumed
run is a new wandb run, named after the step it resumed from.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from stages.common.config import SPAConfig, TrackingConfig, to_dict
from stages.common.console import Console
from stages.common.errors import UserError

#: Tracker -> (the module it imports, the package that provides it).
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
TENSORBOARD_DIR = "tensorboard"


def trackers(config: TrackingConfig) -> list[str]:
    """The trackers `config` names ("none" names none)."""
    return sorted({name for name in config.report_to if name != "none"})


def check(config: TrackingConfig) -> None:
    """Refuse, before any work, a tracker list that cannot be honoured: "none" beside a tracker,
    or a tracker whose package is not installed (the error gives the pip command)."""
    names = trackers(config)
    if names and "none" in config.report_to:
        raise UserError(f"tracking.report_to lists none beside {', '.join(names)}; give either none or trackers")
    for name in names:
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise UserError(f"report_to names {name}, which is not installed; pip install {package}")


def numbers(row: dict[str, Any]) -> dict[str, float]:
    """The figures of a metrics row a tracker records: finite numbers, `step` (the x axis) aside."""
    return {key: float(value) for key, value in row.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


def start(config: SPAConfig, out: str | Path, stage: str, resumed_after: int | None, console: Console,
          main: bool = True) -> Tracker:
    """The trackers `config.tracking` names for the run of `stage` in `out`, given the resolved
    config; `resumed_after` is the step a resumed run continues after (None for a fresh run). Off
    on every process but the `main` one."""
    names = trackers(config.tracking) if main else []
    writers: list[Any] = []
    if "tensorboard" in names:
        writers.append(_TensorBoard(Path(out) / TENSORBOARD_DIR, to_dict(config), resumed_after))
    if "wandb" in names:
        writers.append(_Wandb(config.tracking, Path(out), stage, to_dict(config), resumed_after, console))
    return Tracker(writers)


class Tracker:
    """The trackers of one run; `log(row)` sends a metrics row to each, `close()` ends them."""

    def __init__(self, writers: list[Any]):
        self.writers = writers

    def log(self, row: dict[str, Any]) -> None:
        figures = numbers(row)
        for writer in self.writers:
            writer.log(int(row["step"]), figures)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _config_text(run_config: dict[str, Any]) -> str:
    import yaml

    text = yaml.safe_dump(run_config, sort_keys=False, allow_unicode=True)
    return "\n".join("    " + line for line in text.splitlines())  # a Markdown code block


class _TensorBoard:
    def __init__(self, log_dir: Path, run_config: dict[str, Any], resumed_after: int | None):
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resumed_after is None else resumed_after + 1
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)
        if resumed_after is None:
            self.writer.add_text("config", _config_text(run_config), 0)

    def log(self, step: int, figures: dict[str, float]) -> None:
        for key, value in figures.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, config: TrackingConfig, out: Path, stage: str, run_config: dict[str, Any],
                 resumed_after: int | None, console: Console):
        import wandb

        out.mkdir(parents=True, exist_ok=True)
        name = out.name if resumed_after is None else f"{out.name} (resumed after step {resumed_after})"
        settings = wandb.Settings(silent=True, console="off", disable_git=True)
        self.run = wandb.init(project=config.wandb_project, name=name, group=str(out), job_type=stage,
                              dir=str(out), mode=config.wandb_mode, config=run_config, settings=settings)
        self.offline = config.wandb_mode == "offline"
        self.console = console

    def log(self, step: int, figures: dict[str, float]) -> None:
        self.run.log(figures, step=step)

    def close(self) -> None:
        where = Path(self.run.settings.sync_dir)
        self.run.finish()
        if self.offline:
            self.console.say(f"wandb: offline run saved in {where}; upload it with `wandb sync {where}`")
