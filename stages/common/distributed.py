"""The processes of one run under a launcher (torchrun, deepspeed): where this process stands, how
the processes meet, and the few collectives the stages use.

A launcher starts the same command once per GPU (or CPU rank), on one node or several, and
describes the run in the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
`start` joins the run in three steps, before the stage writes anything:

1. **Rendezvous**: every rank checks in at the TCP store at MASTER_ADDR:MASTER_PORT (torchrun's
   own store, or one that rank 0 opens). When the ranks have not all met within
   ``SPA_DIST_START_TIMEOUT`` seconds (default 300), each rank stops with one line.
2. **Same config**: each rank leaves the hash of its config there; if a rank's differs from rank
   0's, every rank stops with one line naming the first setting that differs.
3. **Process group**: gloo on the CPU, NCCL on CUDA. Its collectives wait up to
   ``SPA_DIST_TIMEOUT`` seconds (default 7200): a rank may have to wait that long for a slower
   rank's rollouts, so this is not the place for a short timeout.

After `start`, a rank that dies ends the run: the launcher stops the other ranks with SIGTERM,
which `start` turns into KeyboardInterrupt (so they print the resume hint as Ctrl-C does), and a
collective whose peer is gone fails with an error that `lost_peer` recognises and the CLI
reports the same way.

Stages that run in one process only (`spa clean`, `spa pipeline`, `spa play`) refuse a world
size above 1 (`require_one_process`) instead of running N copies that write the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from stages.common.errors import UserError
from stages.common.runs import first_difference

#: Seconds a rank waits for the others to check in at the start.
START_TIMEOUT_ENV, START_TIMEOUT_S = "SPA_DIST_START_TIMEOUT", 300.0
#: Seconds a collective waits for its slowest rank.
TIMEOUT_ENV, TIMEOUT_S = "SPA_DIST_TIMEOUT", 7200.0
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: its rank among `world` processes, its rank on its node
    (`local_rank`, which picks its GPU) and its torch device."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def main(self) -> bool:
        """Rank 0 writes the run's files and prints its messages."""
        return self.rank == 0


# ---- where this process stands ---------------------------------------------------------------------


def launched_world() -> int:
    """The number of processes the launcher started (WORLD_SIZE; 1 without a launcher)."""
    return _env_int("WORLD_SIZE", 1)


def launched_rank() -> int:
    return _env_int("RANK", 0)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"the environment variable {name} must be an integer, got {text!r}; start spa "
                        "directly or through torchrun / deepspeed, which set it") from None
    if value < 0:
        raise UserError(f"the environment variable {name} must be >= 0, got {value}")
    return value


def rank_device(device: str) -> str:
    """This process's device: on CUDA the GPU of its local rank (``LOCAL_RANK``, 0 without a
    launcher), which also becomes torch's current device. Whatever touches CUDA first in a rank
    (a memory query, a model load) must come after this: CUDA opens a context, ~0.5 GiB held for
    the whole run, on the current device, which is GPU 0 until it is set. Other devices are
    returned as they are."""
    if not device.startswith("cuda"):
        return device
    import torch

    local_rank = _env_int("LOCAL_RANK", 0)
    torch.cuda.set_device(local_rank)
    return f"cuda:{local_rank}"


def require_one_process(command: str, how: str) -> None:
    """Refuse to run `command` as one of several launched processes (they would all write the
    same files); `how` says what to do instead."""
    world = launched_world()
    if world > 1:
        raise UserError(f"spa {command} runs in one process, but a launcher started {world} (WORLD_SIZE={world}); "
                        f"{how}")


def split_evenly(count: int, world: int, rank: int) -> range:
    """Rank `rank`'s contiguous block of `count` items split over `world` ranks: the first
    ``count % world`` ranks get one more."""
    size, extra = divmod(count, world)
    start = rank * size + min(rank, extra)
    return range(start, start + size + (rank < extra))


# ---- joining the run -------------------------------------------------------------------------------


def start(device: str, config: dict[str, Any], need_group: bool = False) -> Dist:
    """Join the run the launcher started (see the module docstring) and return this process's
    place in it. `config` is what every rank must agree on (the stage's whole config).

    One process gets no process group, unless `need_group` (DeepSpeed wants one even then): a
    one-process group on a free local port.
    """
    world = launched_world()
    if world == 1 and not need_group:
        return Dist(device=device)
    if world > 1:
        missing = [name for name in _LAUNCHER_VARS if not os.environ.get(name)]
        if missing:
            raise UserError(f"WORLD_SIZE is {world} but {', '.join(missing)} not set; start spa through torchrun "
                            "or deepspeed, which set them")
    import torch

    if world == 1 and not torch.distributed.is_initialized():
        # A group of one on a port of its own, whatever an earlier run left in the environment (a
        # child of a process that ran a stage inherits its MASTER_PORT, where that store listens).
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)

    rank, local_rank = launched_rank(), _env_int("LOCAL_RANK", 0)
    if rank >= world:
        raise UserError(f"RANK is {rank} but WORLD_SIZE is {world}; start spa through torchrun or deepspeed")
    device = rank_device(device)
    if torch.distributed.is_initialized():  # a second stage in the same process (tests, notebooks)
        return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device)
    store = _rendezvous(rank, world, config)
    timeout = timedelta(seconds=_timeout(TIMEOUT_ENV, TIMEOUT_S))
    store.set_timeout(timeout)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    torch.distributed.init_process_group(backend, store=torch.distributed.PrefixStore("default_pg", store),
                                         rank=rank, world_size=world, timeout=timeout)
    if world > 1:
        _stop_on_sigterm()
    return Dist(rank, world, local_rank, device)


def wait_for_all_ranks() -> None:
    """Once this rank's stage has succeeded, wait for every other rank of a launched run to finish
    its own: `exit_rank` then takes nothing away from a peer that still needs this one."""
    if _launched_group():
        sys.modules["torch"].distributed.barrier()


def exit_rank() -> None:
    """End this process at once, with exit status 0, if it is one rank of a launched run of several
    (after `wait_for_all_ranks`). The interpreter's own exit tears down gloo's C++ threads, and that
    can abort a finished rank (SIGABRT, "terminate called without an active exception"), which the
    launcher counts as a failed run, even with the process group destroyed first. Every artifact is
    already closed by then; only the console is flushed."""
    if _launched_group():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _launched_group() -> bool:
    torch = sys.modules.get("torch")
    return launched_world() > 1 and torch is not None and torch.distributed.is_available() \
        and torch.distributed.is_initialized()


def _rendezvous(rank: int, world: int, config: dict[str, Any]):
    """Check in at the run's TCP store, wait for every rank, and compare configs (module docstring)."""
    import torch
    from torch.distributed import DistError, PrefixStore

    seconds = _timeout(START_TIMEOUT_ENV, START_TIMEOUT_S)
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"

    def unreachable(err: BaseException) -> UserError:
        return UserError(f"rank {rank} of {world} did not meet the other ranks at {address} within {seconds:g} s "
                         f"({_first_line(err)}); start every rank with the same command, MASTER_ADDR and "
                         f"MASTER_PORT, or raise {START_TIMEOUT_ENV}")

    try:
        if rank > 0 or _agent_store():  # a client: wait for the store quietly (torch logs every failed try)
            _wait_for_port(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), seconds)
        store, _, _ = next(torch.distributed.rendezvous("env://", rank, world, timeout=timedelta(seconds=seconds)))
        spa = PrefixStore("spa-start", store)
        spa.set(f"config/{rank}", json.dumps(config, sort_keys=True, default=str))
        spa.wait([f"config/{r}" for r in range(world)], timedelta(seconds=seconds))
    except (DistError, RuntimeError, ValueError, OSError) as err:
        raise unreachable(err) from None
    configs = [json.loads(spa.get(f"config/{r}")) for r in range(world)]
    spa.set(f"read/{rank}", "1")
    digests = [hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest() for c in configs]
    other = next((r for r in range(1, world) if digests[r] != digests[0]), None)
    if other is not None:
        if rank == 0 and not _agent_store():  # rank 0 holds the store: let the others read first
            try:
                spa.wait([f"read/{r}" for r in range(world)], timedelta(seconds=seconds))
            except (DistError, RuntimeError):
                pass
        difference = first_difference(configs[0], configs[other])
        raise UserError(f"rank {other} was started with another config than rank 0 ({difference}); start every "
                        "rank with the same command and config files")
    return store


def _wait_for_port(host: str, port: int, seconds: float) -> None:
    """Return once `host:port` accepts a connection; OSError after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, seconds)):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise OSError(f"nothing answered at {host}:{port}: {err.strerror or err}") from None
            time.sleep(0.5)


def _agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def _timeout(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{name} must be a number of seconds > 0, got {text!r}")
    return value


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _stop_on_sigterm() -> None:
    """A launcher stops the other ranks with SIGTERM when one dies: end like Ctrl-C (the stage's
    cleanup runs, then the resume hint) instead of vanishing without a word."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


#: How gloo and NCCL word a collective whose peer is gone (they raise plain RuntimeErrors).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
              "ProcessGroupNCCL", "ProcessGroupGloo")


def lost_peer(err: BaseException) -> bool:
    """Whether `err` is a collective that failed because another rank of the run is gone."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    if torch.distributed.get_world_size() < 2:
        return False
    if isinstance(err, torch.distributed.DistError):
        return True
    return isinstance(err, RuntimeError) and any(mark in str(err) for mark in _PEER_GONE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- collectives (each is the identity for one process) ------------------------------------------


def barrier(dist: Dist) -> None:
    import torch

    if dist.world > 1:
        torch.distributed.barrier()


def all_reduce_sum(values: list[float], dist: Dist) -> list[float]:
    """Sum a few numbers over all ranks."""
    if dist.world == 1:
        return list(values)
    import torch

    tensor = torch.tensor(values, dtype=torch.float64, device=dist.device)
    torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(value: int, dist: Dist) -> int:
    if dist.world == 1:
        return value
    import torch

    tensor = torch.tensor([value], dtype=torch.int64, device=dist.device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor.item())


def all_gather(obj: Any, dist: Dist) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (pickled: objects the run itself made)."""
    if dist.world == 1:
        return [obj]
    import torch

    gathered: list[Any] = [None] * dist.world
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


def broadcast(obj: Any, dist: Dist) -> Any:
    """Rank 0's `obj` on every rank."""
    if dist.world == 1:
        return obj
    import torch

    box = [obj if dist.main else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
