"""`spa sft`: world-model fine-tuning (the paper's §2.2, eq. 2) in one readable training loop.

    sft.jsonl (spa clean) + model  ->  OUT/epoch-{k}/, OUT/final/, OUT/metrics.jsonl,
                                       OUT/trainer_state/, OUT/manifest.json

`sft.data` may also be SPA's released data: a `wm_train.parquet` (its `wm_val.parquet` beside it is
the validation data) or a hub dataset id such as `tyzhu/SPA-sokoban-data`, downloaded where the
network allows (`stages.common.spa_data`); each of its rows trains its response.

Each epoch shuffles the rows with (seed, epoch) and cuts them into global batches of
`global_batch` rows. One optimizer step runs this rank's micro-batches
(`stages.training.sft_data`: the rows as one prefix tree, their common tokens computed once; on
a CPU with plain torch the tree trained node by node, `stages.training.tree_passes`),
takes the token cross-entropy over the trained tokens (assistant turns: the whole `<think>` with
the ground-truth `<observation>` and `<prediction>`, the `<answer>`, the end-of-turn token),
aggregates it over the whole global batch as `sft.loss_agg` says (`stages.training.loss_agg`;
token-mean: divided by the global batch's trained-token count; seq-mean-token-mean: each row's
token mean, averaged over the rows), and takes one clipped AdamW step on a cosine schedule with
linear warmup. The logged `loss` is the token mean of the cross-entropy whatever the aggregation,
as `val_loss` is. At each epoch's end: validation loss, an HF checkpoint
`epoch-{k}/`, then the resumable `trainer_state/`. The defaults are the paper's (lr 1e-4, betas
(0.9, 0.95), wd 0.01, 10% warmup, clip 1.0, 16 rows a step, 5 epochs, 2048 tokens with left
truncation, seed 1).

The model and its engine come from `stages.training.trainable` (`zero_stage: auto`: DeepSpeed
ZeRO-2 on CUDA and over several processes, plain torch for one CPU process; LoRA when `lora_rank > 0`,
saved merged so checkpoints load as plain models); the run directory is
`stages.training.checkpoints.RunDir`.

Simplifications, nanochat style:
- the engine trains the model as PPO's actor (`stages.training.policy.StepPolicy`) at temperature
  1: the cross-entropy is minus its log-probs, computed only at the positions whose next token is
  trained, which skips the LM head and the softmax on prompt tokens, and a chunk of positions at a
  time, so a micro-batch's logits never exist whole;
- the data order is a pure function of (seed, epoch) and nothing else draws random numbers (the
  bundled models have no dropout), so resuming needs the weights, optimizer, schedule and a step
  counter only; rank 0's torch RNG state is saved and restored as well;
- the last global batch of an epoch may hold fewer rows; it is normalised by its own token (or
  row) count;
- after the last epoch `trainer_state/` keeps only its `progress.json` (the weights are in
  `final/`), which is how `--resume` on a finished run knows to stop at once.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from stages.common import artifacts, distributed, rss, spa_data, tracking
from stages.common.config import SPAConfig, to_dict
from stages.common.console import Console
from stages.common.errors import UserError
from stages.training import engine as eng
from stages.training import loss_agg, memory, trainable, tree_passes
from stages.training.checkpoints import RunDir, copy_checkpoint, save_hf_checkpoint
from stages.training.sft_data import (
    DataStats,
    Example,
    collate,
    describe,
    epoch_steps,
    rank_micro_batches,
    read_rows,
    step_plan,
    tokenize_rows,
)

DRY_RUN_FILE = "dry_run.txt"
DRY_RUN_ROWS = 3
#: Settings that may change between a run and its resume without changing what is computed.
RESUME_FREE = {"out", "resume", "val_data", "save_every_steps", "stop_after_steps", "deepspeed_config",
               "gradient_checkpointing"}


def run(config: SPAConfig, dry_run: bool = False) -> dict:
    """Train (or, with `dry_run`, only write the first rows' tokens and masks). Returns a summary."""
    config = trainable.with_engine_stage(config, "sft")
    cfg, console = config.sft, Console(config.quiet)
    tracking.check(config.tracking)
    if not dry_run:
        memory.require_fit(config, "sft", distributed.launched_world())  # on a GPU: before anything loads
    if cfg.lora_rank > 0 and cfg.zero_stage == 3:
        raise UserError("LoRA with ZeRO-3 is not supported; use --set sft.zero_stage=2 (LoRA weights are small)")
    data, spa_val = spa_data.locate(cfg.data)
    if not data.is_file():
        raise UserError(f"training data {cfg.data} does not exist; write it with `spa clean`")
    if str(data) != cfg.data:  # a hub dataset, downloaded: the run records (and hashes) the local file
        config = dataclasses.replace(config, sft=dataclasses.replace(cfg, data=str(data)))
        cfg = config.sft
    tokenizer = _tokenizer(config.model)
    train, stats = _load(cfg.data, tokenizer, cfg, "training data")
    if dry_run:
        return _dry_run(Path(cfg.out), train, stats, tokenizer, console)
    val_file = _val_file(cfg, spa_val)
    val = _load(val_file, tokenizer, cfg, "validation data")[0] if val_file else []
    run_dir = RunDir(cfg.out, "sft")
    resuming = run_dir.check(settings(config), cfg.resume, scratch=(DRY_RUN_FILE,))
    saved = run_dir.progress() if resuming else None
    if saved is not None and saved["progress"]["done"]:
        return _already_complete(run_dir, saved, console)
    inputs = {"data": cfg.data, **({"val_data": str(val_file)} if val_file else {})}
    return _Trainer(config, tokenizer, train, val, stats, run_dir, inputs).fit(resuming)


def settings(config: SPAConfig) -> dict:
    """What decides the trained model: the sft settings that change the computation, the model,
    its precision and the data."""
    sft = {k: v for k, v in dataclasses.asdict(config.sft).items() if k not in RESUME_FREE}
    return {"sft": sft, "model": config.model.name, "dtype": config.model.dtype,
            "data_sha256": artifacts.file_sha256(config.sft.data)}


# ---- inputs and outputs ------------------------------------------------------------------------


def _tokenizer(model_config):
    from stages.common.models import load_tokenizer

    try:
        return load_tokenizer(model_config.name, model_config.trust_remote_code)
    except ValueError as err:  # e.g. a model directory saved without its tokenizer
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"cannot load a tokenizer for {model_config.name!r}: {first}; save the tokenizer "
                        "(tokenizer.save_pretrained) into the model directory") from None


def _load(path, tokenizer, cfg, what: str) -> tuple[list[Example], DataStats]:
    examples, stats = tokenize_rows(read_rows(path, what), tokenizer, cfg.max_length, cfg.state_text)
    if not examples:
        raise UserError(f"no row of {path} has a trained token within max_length {cfg.max_length} "
                        f"({stats.dropped_empty} rows dropped); raise sft.max_length or check 'train' flags")
    return examples, stats


def _val_file(cfg, spa_val: Path | None) -> Path | None:
    if cfg.val_data:
        if not Path(cfg.val_data).is_file():
            raise UserError(f"validation data {cfg.val_data} does not exist")
        return Path(cfg.val_data)
    if spa_val is not None:  # SPA's wm_val.parquet beside its wm_train.parquet
        return spa_val
    default = artifacts.val_path(cfg.data)  # spa clean writes it, possibly empty (val_fraction 0)
    return default if default.is_file() and default.read_text(encoding="utf-8").strip() else None


def _already_complete(run_dir: RunDir, saved: dict, console: Console) -> dict:
    if not (run_dir.final / "config.json").is_file() and distributed.launched_rank() == 0:  # one writer
        last = run_dir.out / f"epoch-{saved['progress']['epoch']}"
        if not (last / "config.json").is_file():
            raise UserError(f"{run_dir.out} is marked complete but has neither final/ nor {last.name}/; "
                            "pick another --out to train again")
        copy_checkpoint(last, run_dir.final)
    console.say(f"sft: {run_dir.out} is already complete ({saved['step']} steps); final model: {run_dir.final}")
    return {**saved.get("result", {}), "out": str(run_dir.out), "final": str(run_dir.final), "complete": True,
            "already_complete": True}


def _dry_run(out: Path, train: list[Example], stats: DataStats, tokenizer, console: Console) -> dict:
    path = out / DRY_RUN_FILE
    text = "".join(describe(ex, tokenizer) for ex in train[:DRY_RUN_ROWS])
    header = (f"# spa sft --dry-run: the first {min(DRY_RUN_ROWS, len(train))} rows as trained. Text between "
              "[[TRAIN]] and [[/TRAIN]] carries loss; the token table repeats it token by token.\n"
              f"# data: {stats.as_dict()}\n\n")
    with artifacts.atomic_write(path) as handle:
        handle.write(header + text)
    console.say(f"sft dry run: {stats.kept} rows, {stats.tokens} tokens, {stats.trained_tokens} trained; "
                f"{stats.truncated} truncated, {stats.dropped_empty} dropped; masks of the first rows in {path}")
    return {"dry_run": str(path), "data": stats.as_dict()}


# ---- the loop ----------------------------------------------------------------------------------


@dataclass
class Progress:
    """Where the run stands: the next step to run is `step` of `epoch` (both 0-based)."""

    epoch: int = 0
    step: int = 0
    global_step: int = 0
    done: bool = False
    tokens: int = 0
    train_seconds: float = 0.0
    last: dict = field(default_factory=dict)  # the last metrics row


class _Trainer:
    def __init__(self, config: SPAConfig, tokenizer, train, val, stats, run_dir: RunDir, inputs: dict):
        self.config, self.cfg = config, config.sft
        self.tokenizer, self.train, self.val, self.stats = tokenizer, train, val, stats
        self.run_dir, self.inputs = run_dir, inputs
        self.sources = [ex.source for ex in train] if self.cfg.merge_turn_rows else None
        self.steps_per_epoch = math.ceil(len(train) / self.cfg.global_batch)
        self.sequence_budget = loss_agg.sequence_budget(config, "sft")
        self.total_steps = self.cfg.epochs * self.steps_per_epoch

    def fit(self, resuming: bool) -> dict:
        from stages.common.models import pick_attention
        from stages.training.policy import StepPolicy

        cfg = self.cfg
        self.dist = trainable.start_processes(self.config.model, cfg.zero_stage, to_dict(self.config))
        self.console = Console(self.config.quiet or not self.dist.main)
        saved = self.run_dir.prepare(self.dist, resuming, to_dict(self.config), settings(self.config), self.inputs)
        self.model, _, mixed = trainable.load_trainable(
            self.config.model, self.dist, zero_stage=cfg.zero_stage, seed=cfg.seed,
            gradient_checkpointing=cfg.gradient_checkpointing, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha)
        attn = getattr(self.model.config, "_attn_implementation", None) or pick_attention(
            self.config.model.attn_implementation, self.dist.device, None)
        self.pack = cfg.packing if cfg.packing is not None else attn == "flash_attention_2"
        self.share = cfg.share_prefix and attn == "sdpa"  # the tree's attention is spa's SDPA
        self.by_node = self.share and tree_passes.applies(self.dist.device, cfg.zero_stage, cfg.gradient_checkpointing,
                                                          self.model.config)
        optim = eng.OptimSettings(cfg.lr, tuple(cfg.betas), cfg.weight_decay, cfg.grad_clip, self.total_steps,
                                  cfg.warmup_ratio)
        policy = StepPolicy(trainable.inner_lm(self.model), temperature=1.0)  # its log-probs: minus the loss
        self.engine = trainable.make_engine(policy, self.dist, mixed, cfg.zero_stage, optim, cfg.offload,
                                            cfg.deepspeed_config, out=self.run_dir.out)
        progress = self._restore() if saved is not None else Progress()
        self._announce(progress, saved is not None)
        resumed_after = progress.global_step if saved is not None else None
        tracker = tracking.start(self.config, self.run_dir.out, "sft", resumed_after, self.console, self.dist.main)
        try:
            with self.run_dir.metrics_log(self.dist) as metrics, tracker:
                return self._epochs(progress, metrics, tracker)
        finally:
            self.engine.close()  # `spa pipeline` runs the next stage in this process

    def _restore(self) -> Progress:
        import torch

        client = self.engine.load_state(self.run_dir.state)
        torch.set_rng_state(client["rng"])
        return Progress(**client["progress"])

    def _announce(self, progress: Progress, resumed: bool) -> None:
        s, cfg = self.stats, self.cfg
        where = (f"resuming at step {progress.global_step} (epoch {progress.epoch + 1}, step {progress.step})"
                 if resumed else "from the start")
        engine = trainable.describe_engine(cfg, self.dist.device)
        precision = trainable.precision_label(self.config.model, self.dist.device)
        self.console.say(f"sft: {self.config.model.name} on {s.kept} rows ({s.truncated} truncated, {s.dropped_empty} "
                         f"dropped), {s.tokens} tokens, {s.trained_tokens} trained; {len(self.val)} validation rows; "
                         f"{self.total_steps} steps of {cfg.global_batch} rows on {self.dist.world}x "
                         f"{self.dist.device} ({engine}, {precision}); -> {self.run_dir.out}; {where}")

    def _epochs(self, progress: Progress, metrics, tracker: tracking.Tracker) -> dict:
        plan: dict[int, list[list[int]]] = {}
        with self.console.progress("sft", self.total_steps, progress.global_step, unit="steps") as bar:
            while not progress.done:
                if progress.epoch not in plan:
                    plan[progress.epoch] = epoch_steps(len(self.train), progress.epoch, self.cfg.seed,
                                                       self.cfg.global_batch, self.sources)
                steps = plan[progress.epoch]
                row = self._train_step(steps[progress.step], progress)
                epoch_end = progress.step == len(steps)
                if epoch_end:
                    row["val_loss"] = self._evaluate()
                progress.last = row
                metrics.append(row)
                tracker.log(row)
                bar.update(row["step"], _figures(row))
                saved = epoch_end or self._save_due(progress)
                if epoch_end:
                    self._end_epoch(progress)  # checkpoint, then the state of the next epoch's step 0
                elif saved:
                    self._save_state(progress)
                if 0 < self.cfg.stop_after_steps <= progress.global_step and not progress.done:
                    if not saved:
                        self._save_state(progress)
                    return self._finish(progress, stopped=True)
        return self._finish(progress, stopped=False)

    def _train_step(self, step_rows: list[int], progress: Progress) -> dict:
        started = time.perf_counter()
        rows = [self.train[r] for r in step_rows]
        # Node passes hold one row's tokens whatever the tree's size: the step's rows make one tree.
        budget = sys.maxsize if self.by_node else self.cfg.micro_batch_tokens
        plans = step_plan(rows, self.dist.world, budget, self.pack, self.share)
        micro = rank_micro_batches(rows, self.dist.rank, self.dist.world, budget, self.pack, self.share)
        trained = sum(row.trained for row in rows)  # of the whole global batch: every rank's rows
        tokens = sum(len(row) for row in rows)  # the rows' tokens, whether or not computed once
        normalizer = loss_agg.batch_normalizer(self.cfg.loss_agg, trained, len(rows), self.sequence_budget)
        lr, loss_sum = self.engine.lr, 0.0
        self.engine.module.train()
        for i, mb in enumerate(micro):
            if self.by_node:  # the shared tokens computed once, the activations of one row held at once
                loss_sum += tree_passes.backward(self.engine, [rows[u] for u in mb.rows], partial(
                    loss_agg.token_weights, mode=self.cfg.loss_agg, normalizer=normalizer), mb.weight)
                continue
            batch = collate([rows[u] for u in mb.rows], self.dist.device, self.share)
            ce = token_ce(self.engine, batch)
            weights = loss_agg.token_weights(batch["rows"], self.cfg.loss_agg, normalizer)
            self.engine.backward((ce * weights).sum() * mb.weight, last=i == len(micro) - 1)
            loss_sum += ce.sum().item() * mb.weight
        grad_norm = self.engine.step()
        (loss_sum,) = distributed.all_reduce_sum([loss_sum], self.dist)
        seconds = time.perf_counter() - started
        progress.step += 1
        progress.global_step += 1
        progress.tokens += tokens
        progress.train_seconds += seconds
        return {"step": progress.global_step, "epoch": round(progress.epoch + progress.step / self.steps_per_epoch, 4),
                "loss": loss_sum / trained, "val_loss": None, "lr": lr, "grad_norm": grad_norm,
                "tokens": tokens, "computed_tokens": sum(mb.tokens for plan in plans for mb in plan),
                "trained_tokens": trained,
                "tokens_per_s": round(tokens / seconds, 2), "seconds": round(seconds, 3),
                "peak_rss_gb": rss.peak()["peak_rss_gb"]}

    def _evaluate(self) -> float | None:
        """Mean token loss over the validation rows (split over ranks; every rank runs the same
        number of forwards, as ZeRO-3 gathers parameters collectively)."""
        if not self.val:
            return None
        import torch

        self.engine.module.eval()
        world, rank = self.dist.world, self.dist.rank
        total, count = 0.0, 0
        with torch.no_grad():
            for j in range(math.ceil(len(self.val) / world)):
                index = rank + j * world
                example = self.val[index if index < len(self.val) else 0]
                ce = token_ce_sum(self.engine, collate([example], self.dist.device))
                if index < len(self.val):
                    total, count = total + ce.item(), count + example.trained
        total, count = distributed.all_reduce_sum([total, count], self.dist)
        self.engine.module.train()
        return total / count

    # -- saving --

    def _end_epoch(self, progress: Progress) -> None:
        progress.epoch, progress.step = progress.epoch + 1, 0
        progress.done = progress.epoch == self.cfg.epochs
        checkpoint = self.run_dir.out / f"epoch-{progress.epoch}"
        save_hf_checkpoint(self.engine, self.model, self.tokenizer, checkpoint, self.dist)
        if progress.done:
            if self.dist.main:
                copy_checkpoint(checkpoint, self.run_dir.final)
            self.run_dir.save_state(self.dist, self._progress_record(progress))  # progress only
        else:
            self._save_state(progress)

    def _save_due(self, progress: Progress) -> bool:
        every = self.cfg.save_every_steps
        return every > 0 and progress.global_step % every == 0

    def _save_state(self, progress: Progress) -> None:
        import torch

        client = {"progress": dataclasses.asdict(progress), "rng": torch.get_rng_state()}
        self.run_dir.save_state(self.dist, self._progress_record(progress),
                                lambda tmp: self.engine.save_state(tmp, client))

    def _progress_record(self, progress: Progress) -> dict:
        return {"step": progress.global_step, "progress": dataclasses.asdict(progress),
                "result": self._result(progress, stopped=not progress.done)}

    def _result(self, progress: Progress, stopped: bool) -> dict:
        val_losses = [r["val_loss"] for r in self.run_dir.read_metrics() if r.get("val_loss") is not None]
        return {
            "out": str(self.run_dir.out), "final": str(self.run_dir.final) if progress.done else None,
            "complete": progress.done, "stopped_early": stopped, "global_step": progress.global_step,
            "total_steps": self.total_steps, "epochs_done": progress.epoch,
            "train_loss": progress.last.get("loss"), "val_loss": val_losses[-1] if val_losses else None,
            "tokens_per_s": round(progress.tokens / progress.train_seconds, 2) if progress.train_seconds else None,
            "data": self.stats.as_dict(), **rss.peak(),
        }

    def _finish(self, progress: Progress, stopped: bool) -> dict:
        result = self._result(progress, stopped)
        if self.dist.main:
            self.run_dir.finish(to_dict(self.config), settings(self.config), result, self.inputs)
        if stopped:
            self.console.say(f"sft: stopped after step {progress.global_step} of {self.total_steps} as asked "
                             f"(stop_after_steps); add --resume to continue")
        else:
            self.console.say(f"sft: done; final model in {self.run_dir.final} (val loss {result['val_loss']})")
        return result


def token_ce(policy, batch: dict):
    """Cross-entropy of each trained token of one micro-batch (``batch["rows"]`` names each one's
    row), from `policy` (a `StepPolicy` at temperature 1, or an engine training one)."""
    import torch

    keep = batch["keep"]
    logprobs, _, _ = policy(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                            rows=torch.zeros_like(keep), cols=keep, targets=batch["targets"],
                            position_ids=batch["position_ids"], layout=batch.get("layout"))
    return -logprobs


def token_ce_sum(policy, batch: dict):
    """Summed cross-entropy of the trained tokens of one micro-batch."""
    return token_ce(policy, batch).sum()


def _figures(row: dict) -> str:
    val = f" val {row['val_loss']:.3f}" if row.get("val_loss") is not None else ""
    return f"loss {row['loss']:.3f}{val} lr {row['lr']:.1e} {row['tokens_per_s']:.0f} tok/s"

