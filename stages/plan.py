"""`spa plan`: the memory every stage of a config needs on each GPU, before anything runs.

    spa plan configs/gpu/sokoban_qwen2.5-1.5b.yaml                 # what `spa pipeline` runs, one 80 GB GPU
    spa plan CONFIG --stage ppo --gpus 2 --gpu-memory 39.4          # `spa ppo` alone, on two 40 GB GPUs

Without `--stage` the stages are those `spa pipeline` runs for the config's arms, each with its arm's
settings (`stages.pipeline.memory_plans`); with it, that one command with the config as given. What
is counted, and how, is `stages.training.memory`'s docstring. The model is sized from its
config.json alone (spa ships those of the paper's models), so planning needs neither the weights nor
the network. `spa sft`, `spa ppo` and `spa pipeline` make the same check on a GPU before they start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages import pipeline
from stages.common.config import SPAConfig
from stages.common.errors import UserError
from stages.common.models import model_shape
from stages.training import memory
from stages.training.memory import GiB, StagePlan

#: The table's columns: a heading and the parts (`StagePlan.parts`) it adds up.
COLUMNS = (("weights", ("weights", "rollout_weights", "perplexity_model")), ("optimizer", ("optimizer",)),
           ("gradients", ("gradients",)), ("fp32 step", ("step",)), ("buckets", ("buckets",)),
           ("activations", ("activations",)), ("scoring", ("scoring",)), ("rollout", ("vllm", "kv_cache")),
           ("context", ("context",)))


@dataclass
class Report:
    """Every stage's plan on `gpus` GPUs of `capacity` bytes; `error` is the one-line refusal of the
    first stage that does not fit ("" when all do)."""

    model: str
    gpus: int
    capacity: int
    stages: list[StagePlan]
    error: str

    @property
    def fits(self) -> bool:
        return not self.error

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "gpus": self.gpus, "gpu_memory_gib": memory.gib(self.capacity),
                "fits": self.fits, "total_gib": memory.gib(max((s.need for s in self.stages), default=0)),
                "error": self.error or None, "stages": [s.to_json() for s in self.stages]}


def run(config: SPAConfig, gpus: int = 1, gpu_memory_gib: float | None = None, stage: str | None = None) -> Report:
    """The plan of `config` (the pipeline's stages, or `stage` alone) on `gpus` GPUs of
    `gpu_memory_gib` GiB each (default: the GPU here, else `memory.DEFAULT_GPU_GIB`)."""
    if gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    if gpu_memory_gib is not None and gpu_memory_gib <= 0:
        raise UserError(f"--gpu-memory must be > 0 GiB, got {gpu_memory_gib:g}")
    if stage is not None and stage not in memory.STAGE_KINDS:
        raise UserError(f"--stage must be one of {', '.join(memory.STAGE_KINDS)}, got {stage!r}")
    capacity = memory.capacity(gpu_memory_gib)
    model = config.model
    if stage is not None:
        shape = model_shape(model.name, model.trust_remote_code)
        plans = [memory.plan_stage(stage, config, shape, gpus, capacity)]
        error = "" if plans[0].fits else memory.too_big(plans[0], config, shape)
        return Report(model.name, gpus, capacity, plans, error)
    the_plan = pipeline.plan(config)
    planned = pipeline.memory_plans(the_plan, gpus, capacity)
    return Report(model.name, gpus, capacity, [plan for _, plan in planned], pipeline.memory_error(planned))


def describe(report: Report, source: str = "") -> Any:
    """The report as a rich table (GiB per GPU), titled with the config, model and GPUs."""
    from rich.table import Table

    gpus = f"{report.gpus} GPU{'s' if report.gpus > 1 else ''} of {report.capacity / GiB:.1f} GiB"
    title = f"spa plan{f' {source}' if source else ''}: {report.model} on {gpus} (GiB per GPU)"
    table = Table(*headings(), title=title, caption=CAPTION, title_justify="left", caption_justify="left")
    table.columns[0].no_wrap = True
    for row in rows(report):
        table.add_row(*row)
    return table


#: What the table's peak is, under it.
CAPTION = ("peak: the stage's largest phase (vLLM sleeps during PPO's update; the optimizer step comes after "
           "the activations are freed). rollout: vLLM's share, or the hf backend's KV cache. CPU: the host "
           "memory offloading takes per GPU.")


def headings() -> list[str]:
    return ["stage", *(name for name, _ in COLUMNS), "peak (phase)", "fits", "CPU (offload)"]


def rows(report: Report) -> list[list[str]]:
    found = []
    for plan in report.stages:
        cells = [_gib(sum(plan.parts.get(part, 0) for part in parts)) for _, parts in COLUMNS]
        peak = f"{plan.need / GiB:.1f} ({plan.peak})" if plan.phases else "-"
        found.append([plan.name, *cells, peak, "yes" if plan.fits else "NO", _gib(plan.cpu)])
    return found


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f}" if nbytes else "-"

