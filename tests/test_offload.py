"""`offload` on a CPU with plain torch: each engine's AdamW moments live in a file between its steps
(`stages.training.engine.OptimizerStateOnDisk`). Training must be the same, bit for bit."""

import os

import pytest
import torch
from torch import nn

from stages.training.engine import OptimSettings, TorchEngine

SETTINGS = OptimSettings(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0, total_steps=10,
                         warmup_ratio=0.2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, ids):
        return self.out(self.embed(ids)).square().mean()


def train(engine: TorchEngine, steps: range, keep_state: bool = True) -> list[float]:
    """`steps` optimizer steps of two micro-batches each, their data drawn from the step number."""
    norms = []
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for micro in range(2):
            engine.backward(engine(ids=torch.randint(0, 11, (4, 5), generator=generator)), last=micro == 1)
        norms.append(engine.step(keep_state))
    return norms


def file_bytes(engine: TorchEngine) -> bytes:
    fd = engine.on_disk.file.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0)


def moments_in_memory(engine: TorchEngine) -> int:
    return sum(value.numel() for state in engine.optimizer.state.values() for value in state.values()
               if value.dim() > 0)


def test_offloaded_moments_train_the_same_weights_and_leave_memory_between_steps(tmp_path):
    plain, offloaded = TorchEngine(Net(), SETTINGS, "cpu"), TorchEngine(Net(), SETTINGS, "cpu", offload_dir=tmp_path)
    assert train(plain, range(4)) == train(offloaded, range(4))
    for (name, a), (_, b) in zip(plain.module.named_parameters(), offloaded.module.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    params = sum(p.numel() for p in plain.module.parameters())
    assert moments_in_memory(plain) == 2 * params and moments_in_memory(offloaded) == 0
    # the file holds both moments of every parameter in fp32, and has no name in the directory
    assert os.fstat(offloaded.on_disk.file.fileno()).st_size == 2 * params * 4
    assert list(tmp_path.iterdir()) == []
    assert [state["step"].item() for state in offloaded.optimizer.state.values()] == [4.0, 4.0, 4.0]
    offloaded.close()
    assert offloaded.on_disk.file.closed


@pytest.mark.parametrize("resumed_offloaded", [False, True])
def test_a_saved_offloaded_state_resumes_either_way(tmp_path, resumed_offloaded):
    """An offloaded engine saves its whole state (moments read back for the write) and stays parked;
    a resumed run, offloaded or not, continues exactly as one that never stopped."""
    whole = TorchEngine(Net(), SETTINGS, "cpu")
    expected = train(whole, range(5))
    first = TorchEngine(Net(), SETTINGS, "cpu", offload_dir=tmp_path / "a")
    train(first, range(3))
    first.save_state(tmp_path / "state", {"step": 3})
    assert moments_in_memory(first) == 0
    second = TorchEngine(Net(), SETTINGS, "cpu", offload_dir=tmp_path / "b" if resumed_offloaded else None)
    assert second.load_state(tmp_path / "state") == {"step": 3}
    assert moments_in_memory(second) == (0 if resumed_offloaded else moments_in_memory(whole))
    assert train(second, range(3, 5)) == expected[3:]
    for a, b in zip(whole.module.parameters(), second.module.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("offloaded", [False, True])
def test_a_last_step_without_kept_state_trains_the_same_and_writes_no_moments(tmp_path, offloaded):
    """`step(keep_state=False)` (PPO's last update when final/ keeps no optimizer state) moves the
    weights exactly as a kept step does, then holds no moments, writes none to the offload file,
    and refuses to step again or to save a state it no longer has."""
    kept = TorchEngine(Net(), SETTINGS, "cpu", offload_dir=tmp_path / "a" if offloaded else None)
    dropped = TorchEngine(Net(), SETTINGS, "cpu", offload_dir=tmp_path / "b" if offloaded else None)
    train(kept, range(3))
    train(dropped, range(2))
    written = file_bytes(dropped) if offloaded else None  # the moments after the second step
    train(dropped, range(2, 3), keep_state=False)
    for (name, a), (_, b) in zip(kept.module.named_parameters(), dropped.module.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert moments_in_memory(dropped) == 0 and dropped.optimizer.state == {}
    if offloaded:  # the third step's moments, which the kept engine wrote, never reached the file
        assert file_bytes(dropped) == written != file_bytes(kept)
    with pytest.raises(RuntimeError, match="cannot step again"):
        dropped.step()
    with pytest.raises(RuntimeError, match="no state to save"):
        dropped.save_state(tmp_path / "state", {})
