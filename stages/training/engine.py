"""Training engines shared by `spa sft` and `spa ppo`: DeepSpeed ZeRO or plain torch, one interface.

* `zero_stage` 1/2/3: `deepspeed.initialize` with a config built from `configs/deepspeed/zero{2,3}.json`
  (stage 1 uses the zero2 file) whose "auto" values are filled from the stage config. It runs on
  CUDA (bf16, NCCL) and on the CPU through DeepSpeed's CPU accelerator (gloo). A single
  process needs no launcher (a one-process group on a free port); several GPUs or nodes come from
  `torchrun` or `deepspeed --no_local_rank`, whose ranks `stages.common.distributed.start` joins
  (rendezvous with a timeout, the same config on every rank). `offload` moves the optimizer (and under ZeRO-3 the
  parameters) to the CPU; on a CPU-only run DeepSpeed ignores it.
* `zero_stage` 0: plain torch, one process, no DeepSpeed: fp32 weights (under bf16 autocast when
  the model dtype is bfloat16), fused AdamW. It is the fallback where DeepSpeed cannot start and
  what most tests use. With `offload` on a CPU it keeps AdamW's moments in a file between steps
  (`OptimizerStateOnDisk`).

Precision (`master_dtype`): a bfloat16 run keeps fp32 weights and computes in bf16. On CUDA,
DeepSpeed does that itself (bf16 module, fp32 copies in the optimizer); plain torch, and every
engine on the CPU, trains fp32 weights under `torch.autocast(bf16)`. On the CPU the autocast route
is the fast one: DeepSpeed's bf16 mode runs slower than fp32 there, while autocast is faster than
fp32 on a CPU with native bf16 matmul (AVX512-BF16/AMX; docs/results.md). float16 needs loss
scaling, which only DeepSpeed on CUDA does.

On a CPU in fp32 both compute the linear layers' products, forward and backward, with oneDNN
instead of PyTorch's BLAS (`stages.common.kernels.linear.onednn_training`, around the forward and the
backward, whose checkpointed recomputations must take the forward's path): the same gradients up
to rounding, faster where that BLAS is slow.

Both take the caller's gradient accumulation: `backward(loss, last)` for every micro-batch (the
caller scales the loss; DeepSpeed's own 1/GAS and 1/world scaling are undone), then `step()` once.
The number of micro-batches may change from step to step (packing), which DeepSpeed allows through
`set_gradient_accumulation_boundary`. Weight decay applies to every parameter, as in SPA's
released trainer (verl).

Checkpoints: `save_state`/`load_state` write and read the full training state (weights, optimizer,
scheduler, a client dict) for an exact resume (`stages.training.checkpoints` writes the Hugging
Face directories).

DeepSpeed builds its CPU communication op the first time it starts on a machine (minutes, JIT,
under a lock file); `make install` builds it ahead (`build_deepspeed_ops`), and `setup_distributed`
never waits on a lock silently (`wait_for_op_build`). Its CPU Adam (optimizer offload, on every
rank) is built the same way on first use, under the same guard.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.common import distributed, rss
from stages.common.artifacts import full_disk_as_oserror
from stages.common.console import Console
from stages.common.distributed import Dist
from stages.common.errors import UserError

DEEPSPEED_DIR = Path(__file__).resolve().parents[2] / "configs" / "deepspeed"
STATE_FILE = "state.pt"
DS_TAG = "state"


# ---- processes ---------------------------------------------------------------------------------


def setup_distributed(device: str, use_deepspeed: bool, config: dict[str, Any] | None = None) -> Dist:
    """This process's place in the run and, under DeepSpeed, the process group.

    The group is joined by `stages.common.distributed.start` (rendezvous with a timeout, the same
    `config` on every rank; without a launcher a one-process group on a free local port), then
    handed to DeepSpeed. Plain torch (`use_deepspeed` False) runs one process.
    """
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # transformers imports deepspeed too; no CUDA probe warning
    if not use_deepspeed:
        if distributed.launched_world() > 1:
            raise UserError("zero_stage 0 (plain torch) runs one process; use --set sft.zero_stage=2 (or "
                            "ppo.zero_stage=2) under a multi-process launcher")
        return Dist(device=device)
    require_deepspeed()
    if device == "cpu":
        wait_for_op_build()
    dist = distributed.start(device, config or {}, need_group=True)
    import deepspeed

    _quiet_deepspeed()
    deepspeed.init_distributed(dist_backend="nccl" if dist.device.startswith("cuda") else "gloo",
                               auto_mpi_discovery=False, verbose=False)
    return dist


def require_deepspeed() -> None:
    """Refuse ZeRO, in one line, where DeepSpeed is not installed (an optional extra: one process
    trains with plain torch without it)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise UserError("zero_stage 1-3 (and every run of several processes) trains with DeepSpeed, which is not "
                        "installed; install it with pip install -e '.[deepspeed]' (make install does), or train "
                        "in one process with plain torch: --set sft.zero_stage=0 / ppo.zero_stage=0")


#: DeepSpeed's CPU communication op and its CPU Adam, built with torch's JIT extension loader.
SHM_OP = "deepspeed_shm_comm"
CPU_ADAM_OP = "cpu_adam"
#: How long to wait for another process's build of it: several times what a first build takes on 2 cores.
OP_BUILD_TIMEOUT_S = 900.0
#: A lock that no live process is building under for this long was left by an interrupted build.
OP_BUILD_GRACE_S = 5.0


def build_deepspeed_ops() -> None:
    """Build DeepSpeed's CPU communication op now (`make install` runs this), so that no training
    run pays for, or waits on, its first JIT build."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    wait_for_op_build()
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


def op_build_dir(op: str = SHM_OP) -> Path:
    """Where torch's extension loader builds DeepSpeed's `op` ($TORCH_EXTENSIONS_DIR or the cache)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(op, verbose=False))


def wait_for_op_build(op: str = SHM_OP, timeout_s: float | None = None,
                      grace_s: float | None = None) -> None:
    """Make sure DeepSpeed will not wait forever on the lock file of its build of `op`.

    torch's loader builds under ``BUILD_DIR/lock`` and every other process waits, with no message
    and no end, until that file is gone; a build that was killed leaves it behind. Here: no lock,
    nothing to do; a lock that no live process is building under (none runs in the build
    directory for `grace_s`) is removed, saying so; otherwise the build is waited for, saying so,
    up to `timeout_s`, after which a UserError names the file to remove.
    """
    timeout_s = OP_BUILD_TIMEOUT_S if timeout_s is None else timeout_s
    grace_s = OP_BUILD_GRACE_S if grace_s is None else grace_s
    lock = op_build_dir(op) / "lock"
    console, started, announced = Console(), time.monotonic(), False
    while lock.exists():
        waited = time.monotonic() - started
        building = _builders(lock.parent)
        if building is not None and not building and waited >= grace_s:
            lock.unlink(missing_ok=True)
            console.say(f"removed {lock}: an interrupted DeepSpeed op build left it, and no process is building")
            return
        if waited >= timeout_s:
            raise UserError(f"DeepSpeed's op build has held {lock} for {waited:.0f} s; if no build is running "
                            f"(ps aux | grep ninja), remove that file and run the command again")
        if (building is None or building) and not announced:
            console.say(f"waiting for another process's build of DeepSpeed's {op} op (lock {lock}; "
                        f"up to {timeout_s / 60:.0f} min)")
            announced = True
        time.sleep(0.5)


def _builders(build_dir: Path) -> list[int] | None:
    """Processes other than this one working in `build_dir` (ninja and the compiler run there), or
    None where that cannot be seen (no /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    target, found = str(build_dir.resolve()), []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(entry / "cwd") == target:
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _quiet_deepspeed() -> None:
    import logging

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


# ---- optimisation ------------------------------------------------------------------------------


@dataclass
class OptimSettings:
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    grad_clip: float
    total_steps: int
    warmup_ratio: float


def cosine_with_warmup(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """LR multiplier of optimizer step s (0-based): linear warmup over int(ratio * total) steps
    reaching 1 on the last warmup step, then cosine decay towards 0 at `total_steps`."""
    warmup = int(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _optimizer(model, settings: OptimSettings, device: str, cpu_adam: bool = False):
    import torch

    # A module may ask for learning rates of its own (a shared-trunk critic's value head)
    if hasattr(model, "optimizer_groups"):
        params = model.optimizer_groups(settings.lr)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    kwargs = {"lr": settings.lr, "betas": tuple(settings.betas), "weight_decay": settings.weight_decay}
    if cpu_adam:  # DeepSpeed's vectorised CPU Adam for optimizer offload
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        wait_for_op_build(CPU_ADAM_OP)  # every rank JIT-builds it on first use, behind one lock
        return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    # fused: one kernel per step, and no foreach temporaries the size of the model (CPU RAM)
    return torch.optim.AdamW(params, fused=True, **kwargs)


# ---- engines -----------------------------------------------------------------------------------


def state_mismatch(path: Path, err: RuntimeError) -> UserError:
    """A saved training state whose weights are not the module's (another model, or a state saved by a
    spa that wrapped the model otherwise): one line, not torch's list of keys."""
    first = str(err).strip().splitlines()[0]
    return UserError(f"{path} holds a training state whose weights do not fit this model ({first}); start "
                     "the run again without --resume, or resume it with the spa version that saved it")


class OptimizerStateOnDisk:
    """An optimizer's per-parameter tensors (AdamW's two moments) held in a file between its steps:
    `park` writes them and lets them go, `restore` reads them back into fresh tensors, bit for bit,
    and `release` lets them go again unwritten when they have not changed since (a checkpoint's
    write). The file has no name (`tempfile.TemporaryFile`), so it is gone when the process ends,
    however it ends. Scalars (AdamW's step count) stay in memory."""

    def __init__(self, optimizer, directory: Path):
        import tempfile

        directory.mkdir(parents=True, exist_ok=True)
        self.optimizer = optimizer
        self.file = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 (open for the engine's life, closed by close)
        self.layout: list[tuple[dict, str, Any, Any]] = []  # (state, key, shape, dtype) in file order
        self.parked = False

    def park(self) -> None:
        import torch

        self.file.seek(0)
        self.layout = []
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    self.file.write(_bytes_of(value.contiguous()))  # a full disk: Python's OSError
                    self.layout.append((state, key, value.shape, value.dtype))
        self.file.flush()
        self.release()

    def release(self) -> None:
        for state, key, _, _ in self.layout:
            del state[key]
        self.parked = True
        rss.return_freed_memory()  # the moments' pages, not only their addresses, go back to the OS

    def restore(self) -> None:
        import torch

        if not self.parked:
            return
        self.file.seek(0)
        for state, key, shape, dtype in self.layout:
            tensor = torch.empty(shape, dtype=dtype)
            view = _bytes_of(tensor)
            if self.file.readinto(view) != len(view):
                raise OSError(f"the optimizer state file ended early (expected {len(view)} bytes for {key!r})")
            state[key] = tensor
        self.parked = False

    @contextlib.contextmanager
    def read_back(self) -> Iterator[None]:
        """The state in memory for a block that does not change it (a checkpoint's write)."""
        if not self.parked:
            yield
            return
        self.restore()
        try:
            yield
        finally:
            self.release()

    def close(self) -> None:
        self.file.close()


def _bytes_of(tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes, without a copy."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


class TorchEngine:
    """Plain torch: the model, fused AdamW, a LambdaLR, clipping, optional bf16 autocast; with
    ``offload_dir`` the optimizer state lives in a file there between steps (`OptimizerStateOnDisk`)."""

    def __init__(self, model, settings: OptimSettings, device: str, autocast_dtype=None,
                 offload_dir: Path | None = None):
        import torch

        self.module = model
        self.optimizer = _optimizer(model, settings, device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(settings.total_steps, settings.warmup_ratio))
        self.grad_clip = settings.grad_clip
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.on_disk = OptimizerStateOnDisk(self.optimizer, offload_dir) if offload_dir is not None else None
        self.state_dropped = False

    def __call__(self, **inputs):
        from stages.common.kernels.linear import onednn_training

        with autocast(self.device, self.autocast_dtype), onednn_training(self.module):
            return self.module(**inputs)

    def backward(self, loss, last: bool = True) -> None:
        from stages.common.kernels.linear import onednn_training

        with onednn_training(self.module):  # checkpointed forwards recompute as they first ran
            loss.backward()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step(self, keep_state: bool = True) -> float:
        """Clip, update, advance the schedule; returns the gradient norm before clipping.

        ``keep_state=False``: the run's last step, whose optimizer state nothing reads again (a final
        checkpoint without it): AdamW's moments are let go after the update instead of kept or
        written to the offload file, and the engine then refuses another step or a state to save."""
        import torch

        if self.state_dropped:
            raise RuntimeError("this engine let its optimizer state go at its last step; it cannot step again")
        params = [p for p in self.module.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip > 0 else float("inf"))
        if self.on_disk is not None:
            self.on_disk.restore()
        self.optimizer.step()
        if not keep_state:
            self.optimizer.state.clear()
            self.state_dropped = True
            rss.return_freed_memory()
        elif self.on_disk is not None:
            self.on_disk.park()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def save_state(self, path: Path, client: dict) -> None:
        import torch

        if self.state_dropped:
            raise RuntimeError("this engine let its optimizer state go at its last step; it has no state to save")
        path.mkdir(parents=True, exist_ok=True)
        in_memory = self.on_disk.read_back() if self.on_disk is not None else contextlib.nullcontext()
        with full_disk_as_oserror(path), in_memory:
            torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(), "client": client}, path / STATE_FILE)

    def load_state(self, path: Path) -> dict:
        state = load_weights_only(path / STATE_FILE, map_location=self.device)
        try:
            self.module.load_state_dict(state["model"])
        except RuntimeError as err:
            raise state_mismatch(path, err) from None
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        client = state["client"]
        if self.on_disk is not None:
            del state  # the loaded moments' only other reference
            self.on_disk.park()
        return client

    def consolidated_state_dict(self) -> dict | None:
        return None  # the module holds every weight: save_pretrained reads it directly

    def full_parameters(self, module) -> Iterator[tuple[str, Any]]:
        """`module`'s (a part of the trained module) named weights, whole."""
        for name, param in module.named_parameters():
            yield name, param.detach()

    def close(self) -> None:
        """Nothing outside this object holds the model or the optimizer state (an offloaded state's
        file has no name: closing it frees its disk space)."""
        if self.on_disk is not None:
            self.on_disk.close()


class DeepSpeedEngine:
    """A `deepspeed.initialize` engine driven with caller-owned gradient accumulation."""

    def __init__(self, model, settings: OptimSettings, dist: Dist, ds_config: dict, autocast_dtype=None):
        import deepspeed
        import torch

        offload = ds_config["zero_optimization"].get("offload_optimizer", {}).get("device") == "cpu"
        optimizer = _optimizer(model, settings, dist.device, cpu_adam=offload)
        schedule = cosine_with_warmup(settings.total_steps, settings.warmup_ratio)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        self.module = self.engine.module
        self.world = dist.world
        self.device = dist.device
        self.autocast_dtype = autocast_dtype
        self.stage = ds_config["zero_optimization"]["stage"]
        # Every file DeepSpeed's load_checkpoint reads goes through its checkpoint engine's load(),
        # which calls torch.load(weights_only=False) in DeepSpeed 0.16-0.19; read them safely instead.
        self.engine.checkpoint_engine.load = _load_deepspeed_file

    def __call__(self, **inputs):
        from stages.common.kernels.linear import onednn_training

        with autocast(self.device, self.autocast_dtype), onednn_training(self.engine.module):
            return self.engine(**inputs)

    def close(self) -> None:
        """Release the model and optimizer state: ZeRO's gradient hooks on the parameters keep the
        optimizer (and through it the engine) alive after the run otherwise, so a second stage in
        the same process (`spa pipeline`) would hold every earlier stage's weights and Adam state."""
        self.engine.destroy()

    def backward(self, loss, last: bool = True) -> None:
        from stages.common.kernels.linear import onednn_training

        # ZeRO averages gradients over ranks; the caller's loss is already normalised globally.
        self.engine.set_gradient_accumulation_boundary(last)
        with onednn_training(self.engine.module):  # checkpointed forwards recompute as they first ran
            self.engine.backward(loss * self.world, scale_wrt_gas=False)

    @property
    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def step(self, keep_state: bool = True) -> float:
        """DeepSpeed's step; its ZeRO optimizer keeps its state whatever `keep_state` says."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def save_state(self, path: Path, client: dict) -> None:
        with full_disk_as_oserror(path):
            self.engine.save_checkpoint(str(path), tag=DS_TAG, client_state={"client": client}, save_latest=False)

    def load_state(self, path: Path) -> dict:
        try:
            loaded, client = self.engine.load_checkpoint(str(path), tag=DS_TAG, load_optimizer_states=True,
                                                         load_lr_scheduler_states=True)
        except RuntimeError as err:
            if "state_dict" not in str(err):  # only a saved layout that is not the module's is the user's to fix
                raise
            raise state_mismatch(path, err) from None
        if loaded is None:
            raise UserError(f"{path} holds no DeepSpeed state to resume from")
        return client["client"]

    def consolidated_state_dict(self) -> dict | None:
        """ZeRO-3 gathers the 16-bit weights onto rank 0 (every rank must call this)."""
        if self.stage < 3:
            return None
        return self.engine._zero3_consolidated_16bit_state_dict()

    def full_parameters(self, module) -> Iterator[tuple[str, Any]]:
        """`module`'s (a part of the trained module) named weights, whole on every rank: under
        ZeRO-3 each is gathered from its shards in turn (every rank must take them all, in order)
        and is valid until the next one is taken; below ZeRO-3 every rank holds them already."""
        import deepspeed

        for name, param in module.named_parameters():
            if self.stage < 3:
                yield name, param.detach()
                continue
            with deepspeed.zero.GatheredParameters([param]):
                yield name, param.detach()


def load_weights_only(path: Path, map_location: Any = None, allowed: list | None = None) -> Any:
    """torch.load that unpickles tensors and plain values only (and the `allowed` classes): a
    trainer state is data, and a tampered one must not run code. Anything else is a UserError."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(allowed or []):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else "unsupported content"
        raise UserError(f"{path} holds more than tensors and plain values ({reason}); spa does not unpickle "
                        "it; resume from a state spa wrote, or start a new --out") from None


def _deepspeed_state_classes() -> list:
    """The classes DeepSpeed pickles into its ZeRO-1/2/3 states besides tensors and plain values."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _load_deepspeed_file(path: str, map_location: Any = None) -> Any:
    return load_weights_only(Path(path), map_location, _deepspeed_state_classes())


def deepspeed_config(stage: int, offload: bool, grad_clip: float, device: str, mixed: str | None,
                     path: str = "", world: int = 1) -> dict:
    """The DeepSpeed config: the user's JSON if given, else configs/deepspeed/zero{2,3}.json, with
    every "auto" value filled from the stage settings, and `stage` unless the user's JSON names one.

    Memory on one GPU (`world` 1): there is nothing to communicate, so no overlapped communication
    (its spare buffers) and small buckets. bf16 micro-batch gradients are summed in fp32
    (``data_types.grad_accum_dtype``; DeepSpeed would otherwise sum them in the model's bf16, where
    PPO's ~30 micro-batches a step lose their low bits): ZeRO-1 in its BF16_Optimizer's fp32
    gradients, ZeRO-2 in an fp32 gradient partition (DeepSpeed >= 0.19.8, pyproject's floor), ZeRO-3
    in its fp32 partitions."""
    source = Path(path) if path else DEEPSPEED_DIR / ("zero3.json" if stage == 3 else "zero2.json")
    try:
        config = json.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"DeepSpeed config {source} does not exist") from None
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read DeepSpeed config {source}: {err}") from None
    cuda = device.startswith("cuda")
    zero = config.setdefault("zero_optimization", {})
    if not path or "stage" not in zero:  # where a user's file names none, DeepSpeed's default would be 0
        zero["stage"] = stage
    if offload and cuda:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if zero["stage"] == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    shared = cuda and world > 1  # several GPUs exchange gradients; one GPU or the CPU has less to gain
    auto = {
        "overlap_comm": shared,  # overlapping needs spare buffers; without communication nothing to overlap
        "reduce_bucket_size": 5e8 if shared else 2e7,  # smaller buckets, less memory
        "allgather_bucket_size": 5e8 if shared else 2e7,
        "stage3_prefetch_bucket_size": 5e7 if cuda else 1e7,
        "stage3_param_persistence_threshold": 1e5,
    }
    _fill_auto(zero, auto)
    _fill_auto(config, {"gradient_clipping": grad_clip, "train_micro_batch_size_per_gpu": 1,
                        "gradient_accumulation_steps": 1})
    config.setdefault("bf16", {})["enabled"] = mixed == "bf16"
    if mixed == "bf16":
        config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    config.setdefault("fp16", {})["enabled"] = mixed == "fp16"
    if mixed == "fp16":
        _fill_auto(config["fp16"], {"loss_scale": 0, "initial_scale_power": 16})
    config.setdefault("steps_per_print", 10**12)
    config.setdefault("wall_clock_breakdown", False)
    config["zero_allow_untested_optimizer"] = True
    return config


def _fill_auto(section: dict, values: dict[str, Any]) -> None:
    for key, value in values.items():
        if section.get(key, "auto") == "auto":
            section[key] = value


def build_engine(model, settings: OptimSettings, dist: Dist, zero_stage: int, offload: bool = False,
                 mixed: str | None = None, ds_config_path: str = "", offload_dir: Path | None = None):
    """The training engine for `model` (already on its device, in `master_dtype`); `offload`: the
    optimizer state in CPU memory (DeepSpeed on CUDA); `offload_dir`: in a file there between steps
    (plain torch)."""
    compute = autocast_dtype(mixed, zero_stage, dist.device)
    if zero_stage == 0:
        return TorchEngine(model, settings, dist.device, autocast_dtype=compute, offload_dir=offload_dir)
    if compute is not None:  # fp32 weights under autocast (see the module docstring)
        config = deepspeed_config(zero_stage, offload, settings.grad_clip, dist.device, None, ds_config_path, dist.world)
        return DeepSpeedEngine(model, settings, dist, config, autocast_dtype=compute)
    config = deepspeed_config(zero_stage, offload, settings.grad_clip, dist.device, mixed, ds_config_path, dist.world)
    return DeepSpeedEngine(model, settings, dist, config)


def autocast_dtype(mixed: str | None, zero_stage: int, device: str):
    """The torch dtype an engine computes in under autocast over fp32 weights (plain torch, and
    DeepSpeed off CUDA), or None: no autocast (fp32, or DeepSpeed's own bf16/fp16 on CUDA)."""
    import torch

    if zero_stage > 0 and device.startswith("cuda"):
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed or "")


def master_dtype(mixed: str | None, zero_stage: int, device: str) -> str:
    """The dtype to load a model in for training: DeepSpeed on CUDA takes the bf16 model and keeps
    fp32 copies itself; every other engine trains fp32 weights (under autocast when mixed)."""
    return "bfloat16" if mixed == "bf16" and zero_stage > 0 and device.startswith("cuda") else "float32"


def autocast(device: str, dtype):
    """`torch.autocast` to `dtype` on the device type of `device`; a no-op when dtype is None."""
    import torch

    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.split(":")[0], dtype=dtype)
