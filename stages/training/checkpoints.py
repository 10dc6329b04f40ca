"""The run directory of `spa sft` and `spa ppo`, and the Hugging Face checkpoints in it.

One layout for both::

    OUT/manifest.json      what made the run: its settings (the "same run?" key of
                           `stages.common.runs`), config, input hashes, versions; the result at the end
    OUT/metrics.jsonl      one row per optimizer step (sft) or PPO step (ppo)
    OUT/epoch-N/ step-N/   Hugging Face checkpoints (`save_pretrained`: safetensors, config,
    OUT/final/             tokenizer with its chat template) that transformers and vLLM load
    OUT/trainer_state/     the newest resumable state: the engines (weights, optimizer, schedule),
                           whatever else the stage keeps, and progress.json (where the run stands)

Every directory is written beside its place and renamed in (`artifacts.atomic_dir`), so a kill
leaves the previous complete copy; `open` cleans up what a kill left. `--resume` continues from
trainer_state/ with the very same settings; metrics rows past the saved state are dropped, since
the resumed run logs those steps again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.common import artifacts, runs
from stages.common.distributed import Dist, barrier
from stages.common.errors import UserError

STATE_DIR = "trainer_state"
PROGRESS_FILE = "progress.json"
METRICS_FILE = "metrics.jsonl"
FINAL_DIR = "final"


class RunDir:
    """The output directory of one training run (see the module docstring)."""

    def __init__(self, out: str | Path, stage: str):
        self.out, self.stage = Path(out), stage
        self.state = self.out / STATE_DIR
        self.metrics = self.out / METRICS_FILE
        self.final = self.out / FINAL_DIR

    def check(self, settings: dict[str, Any], resume: bool, scratch: tuple[str, ...] = ()) -> bool:
        """Whether an earlier run of the same `settings` is to be continued (True) or a fresh one
        starts (False); refused unless `resume` and the recorded settings are equal. Reads only,
        so every rank can check before the processes start; files named in `scratch` (a dry run's)
        are not a run."""
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"--out {self.out} is a file; {self.stage} writes a directory")
        artifacts.check_writable(self.out)
        holds_run = self.out.is_dir() and any(p.name not in scratch for p in self.out.iterdir())
        return runs.start(self.out, settings, resume, self.stage, holds_run)

    def prepare(self, dist: Dist, resuming: bool, config: dict[str, Any], settings: dict[str, Any],
                inputs: dict[str, str | Path] | None = None) -> dict[str, Any] | None:
        """After `check`, once the processes run: rank 0 cleans up after a kill, records the
        settings and drops the metrics past the saved state. Returns the saved progress to continue
        from (on every rank), or None for a fresh start."""
        if dist.main:
            artifacts.remove_leftovers(self.out)
            self.out.mkdir(parents=True, exist_ok=True)
            runs.record(self.out, self.stage, config, settings, inputs)
            progress = self.progress() if resuming else None
            if progress is None:
                self.metrics.unlink(missing_ok=True)
            else:
                self.forget_metrics_after(progress["step"])
        barrier(dist)
        return self.progress() if resuming else None

    def progress(self) -> dict[str, Any] | None:
        path = self.state / PROGRESS_FILE
        return artifacts.read_json(path) if path.is_file() else None

    def forget_metrics_after(self, step: int) -> None:
        """Drop the metrics rows of steps after `step` (the resumed run logs them again)."""
        if self.metrics.exists():
            rows, _ = artifacts.read_jsonl(self.metrics, skip_bad=True)
            artifacts.write_jsonl(self.metrics, [row for row in rows if row.get("step", 0) <= step])

    def metrics_log(self, dist: Dist) -> artifacts.JsonlAppender | _NoMetrics:
        """Where the run's metrics rows go: appended to metrics.jsonl by rank 0, dropped elsewhere."""
        return artifacts.JsonlAppender(self.metrics) if dist.main else _NoMetrics()

    def read_metrics(self) -> list[dict]:
        return artifacts.read_jsonl(self.metrics, skip_bad=True)[0] if self.metrics.is_file() else []

    def save_state(self, dist: Dist, progress: dict[str, Any], write: Callable[[Path], None] | None = None) -> None:
        """Replace trainer_state/ with `write(tmp)`'s files plus progress.json (every rank calls this;
        `write` runs on every rank, into the same directory). Without `write`, only progress.json
        is kept (a finished run no longer needs its optimizer)."""
        tmp = self.out / f".{STATE_DIR}.tmp"
        if dist.main:
            artifacts.remove_leftovers(self.out)
            tmp.mkdir()
        barrier(dist)
        try:
            if write is not None:
                with artifacts.full_disk_as_oserror(tmp):
                    write(tmp)
            barrier(dist)
            if dist.main:
                artifacts.write_json(tmp / PROGRESS_FILE, progress)
                artifacts.replace_dir(tmp, self.state)
        except BaseException:
            if dist.main:  # a full disk: give the space of the half-written state back
                artifacts.remove_leftovers(self.out)
            raise
        barrier(dist)

    def finish(self, config: dict[str, Any], settings: dict[str, Any], result: dict[str, Any],
               inputs: dict[str, str | Path] | None = None) -> None:
        runs.record(self.out, self.stage, config, settings, inputs, result=result)


class _NoMetrics:
    """What ranks other than 0 log metrics to."""

    def append(self, row: dict) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        pass


# ---- Hugging Face checkpoints --------------------------------------------------------------------


def save_hf_checkpoint(engine, model, tokenizer, path: str | Path, dist: Dist) -> None:
    """Write `model` (the causal LM inside `engine.module`) as a `save_pretrained` directory,
    atomically; ZeRO-3 shards are gathered first, so every rank must call this."""
    state = engine.consolidated_state_dict()
    if state is not None and model is not engine.module:
        prefix = next(name for name, module in engine.module.named_modules() if module is model) + "."
        state = {key.removeprefix(prefix): value for key, value in state.items() if key.startswith(prefix)}
    if dist.main:
        write_pretrained(model, tokenizer, Path(path), state)
    barrier(dist)


def write_pretrained(model, tokenizer, path: Path, state_dict: dict | None = None) -> None:
    """`save_pretrained` into a temp directory beside `path`, then renamed in; LoRA adapters are
    merged, so that `AutoModelForCausalLM.from_pretrained` loads it as a plain model."""
    if is_peft(model):
        state_dict, model = merged_lora_state_dict(model), model.get_base_model()
    with artifacts.atomic_dir(path) as tmp:  # a failed write comes out as the OSError it names
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def merged_lora_state_dict(peft_model) -> dict:
    """The base model's weights with every LoRA delta added, under the base model's own key names.
    Computed on copies: the live model is not merged and unmerged (that would not be bit-exact)."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            deltas[f"{name}.weight"] = sum(module.get_delta_weight(a) for a in module.active_adapters)
    merged = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        value = value.detach()
        merged[key] = (value + deltas[key].to(value.dtype)) if key in deltas else value.clone()
    return merged


def copy_checkpoint(src: Path, dst: Path) -> None:
    """`dst` as a copy of the checkpoint `src` (final/ of the last epoch), hard-linking files where
    the filesystem allows."""
    import os
    import shutil

    with artifacts.atomic_dir(dst) as tmp:
        for item in src.iterdir():
            if not item.is_file():
                continue
            try:
                os.link(item, tmp / item.name)
            except OSError:  # another filesystem, or no hard links
                shutil.copy2(item, tmp / item.name)
