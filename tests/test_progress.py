"""A rollout's ETA (`stages.agent.proxy.rollout_eta`, shown through `RolloutMeter` on both progress
displays): from the episodes finished so far, none before the first one ends."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from helpers import FakeClock

from stages.agent import proxy
from stages.agent.proxy import RolloutMeter, rollout_eta
from stages.common import console as console_module
from stages.common.console import Console, Progress


def test_the_eta_is_the_episodes_left_at_the_rate_they_finished():
    assert rollout_eta(seconds=60.0, finished=4, planned=16) == 180.0
    assert rollout_eta(seconds=45.0, finished=3, planned=4) == 15.0
    assert rollout_eta(seconds=91.0, finished=16, planned=16) == 0.0


def test_no_eta_before_an_episode_has_finished():
    assert rollout_eta(seconds=60.0, finished=0, planned=16) is None
    assert rollout_eta(seconds=0.0, finished=0, planned=0) is None


@pytest.fixture
def clock(monkeypatch):
    """One fake clock for the progress line (monotonic) and the meter (perf_counter)."""
    fake = FakeClock()
    monkeypatch.setattr(console_module.time, "monotonic", fake)
    monkeypatch.setattr(proxy.time, "perf_counter", fake)
    return fake


def finished_episode(turns: int, success: bool = False):
    return SimpleNamespace(turns=[None] * turns, success=success)


def test_a_rollouts_progress_lines_show_no_eta_until_an_episode_ends_then_its_estimate(clock, monkeypatch):
    """8 episodes of up to 5 turns: after the first turn of all of them (8 of 40 turns: the turn
    rate would say 4 times the time so far) no ETA; then one of 2 turns and one of 3 finish at
    40 s and 61 s: 40 x 7 / 1, then 61 x 7 / 1 and 61 x 6 / 2 seconds left."""
    stream = io.StringIO()
    monkeypatch.setattr(console_module.sys, "stderr", stream)
    monkeypatch.setattr(console_module, "LOG_EVERY_S", 0.0)  # every update a line
    with Console().progress("generate", 0, unit="turns") as bar:
        meter = RolloutMeter(bar)
        meter.plan(8, 5)
        clock.now += 20
        meter.generated(800, 8)
        clock.now += 20
        meter.generated(700, 7)
        meter.finished(finished_episode(2))
        clock.now += 21
        meter.generated(600, 6)
        meter.finished(finished_episode(3, success=True))
        assert bar.eta_seconds() == 183.0
    lines = stream.getvalue().splitlines()
    assert [line.split("; ")[-1] for line in lines] == [
        "0s elapsed", "20s elapsed", "40s elapsed",
        "40s elapsed, ETA 4m40s", "1m01s elapsed, ETA 7m07s", "1m01s elapsed, ETA 3m03s"]
    assert lines[-1].startswith("generate: 26/40 turns (65%) episodes 2/8 (1 solved), 2100 tok (34/s)")


def test_the_terminal_bar_shows_the_same_eta(clock):
    bar = Progress("eval", 0, 0)
    meter = RolloutMeter(bar)
    meter.plan(4, 5)
    text = console_module._EtaText(bar)
    assert text.__rich__().plain == ""
    clock.now += 30
    meter.finished(finished_episode(1))
    assert bar.eta_seconds() == 90.0  # 3 episodes left at 30 s each
    assert text.__rich__().plain == "ETA 1m30s"


def test_a_rollout_inside_another_count_leaves_that_counts_eta_alone():
    """ppo's bar counts steps; the rollout of a step shows in its figures only."""
    bar = Progress("ppo", 10, 2)
    meter = RolloutMeter(bar, "step 3")
    meter.plan(4, 5)
    meter.finished(finished_episode(1))
    assert bar.estimate is None and bar.eta_seconds() is None  # no step done since the bar opened
