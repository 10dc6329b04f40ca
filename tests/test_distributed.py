"""One run over several processes (`stages.common.distributed`), on the CPU with gloo: `spa ppo`,
`spa eval` and `spa generate` under torchrun with two ranks give what one process gives, a rank
killed mid-run is resumed without a lost or repeated step, and a launch that cannot work ends
with one line on every rank before anything is written.

The model is a tiny random Llama taught to answer FrozenLake with a legal move or a malformed
one (`helpers.answering_model`), so the episodes of a step score differently and the std filter
has real choices to make. Rollouts use ``rollout.batch_size=2`` (one group a wave), which cuts
each rank's groups into the same waves as one process's: the samples are then the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import aggregate_by_definition, assert_same_weights
from safetensors.torch import load_file

from stages.common import distributed
from stages.common.config import load_config
from stages.common.errors import UserError
from stages.training import ppo_samples

#: Every launched rank gets one thread, as torchrun gives each; the one-process reference too.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
#: The learning rate of actor and critic: small enough that each step changes the tiny model's
#: log-probs by far less than the clip range, so the last-bit differences of another summation order
#: stay last-bit through the steps. (At 1e-3 two steps drive it towards a uniform distribution, and
#: such differences grow into different losses in the second step.)
LR = 1e-5
#: PPO on FrozenLake, one turn, 8 groups x 2 a step, half the groups kept, 2 mini-batches of 4.
MINI_BATCH = 4
PPO_SETTINGS = [
    "env.name=frozen_lake", "rollout.max_turns=1", "rollout.max_new_tokens=16",
    "rollout.groups=8", "rollout.group_size=2", "rollout.batch_size=2", "ppo.filter_ratio=0.5",
    f"ppo.mini_batch={MINI_BATCH}", "ppo.micro_batch_tokens=800", f"ppo.actor_lr={LR}", f"ppo.critic_lr={LR}",
    "ppo.save_every=1", "ppo.val_every=1", "eval.seeds=2", "eval.pass_k=2", "ppo.zero_stage=2",
]
#: Same-run figures that depend on the episodes only: equal when the same episodes were played.
EPISODE_FIGURES = ("reward", "success", "format_penalty", "turns", "response_length", "sequence_length",
                   "kept_episodes", "kept_reward", "kept_seeds", "seed_counter", "val_pass@1", "val_pass@2")
#: Figures of the update: equal up to the float rounding of another summation order.
UPDATE_FIGURES = ("pg_loss", "value_loss", "entropy", "clip_frac", "ppo_kl", "vf_clip_frac", "actor_grad_norm",
                  "critic_grad_norm", "logp_diff", "value_mean")
#: The update figures that are means of differences of order-1 quantities (whitened advantages
#: times ratios, log-probs, counts of tokens): rounding moves them by a share of 1, not of themselves.
DIFFERENCE_FIGURES = ("pg_loss", "clip_frac", "ppo_kl", "vf_clip_frac", "logp_diff")
#: float32's unit roundoff: one rounding moves a value by at most this share of it.
UNIT_ROUNDOFF = 2.0**-24


def summation_tolerance(reference: dict, step: int, mini_batch: int = MINI_BATCH) -> float:
    """The relative difference that another order of float32 sums may make in `step`'s figures.

    A sum of n terms computed in two orders differs by at most about n * u times the sum of the
    terms' magnitudes (u the unit roundoff); a mini-batch sums over its tokens, n = mini-batch x
    mean sequence length. Each step adds its own rounding to what the previous one left in the
    weights, which a model kept sane by a small learning rate carries on without amplifying it:
    `step` steps, `step` times the bound."""
    tokens = mini_batch * reference[step]["sequence_length"]
    return step * tokens * UNIT_ROUNDOFF


def assert_same_update(row: dict, reference: dict, step: int, mini_batch: int = MINI_BATCH) -> None:
    """`row`'s update figures equal the reference's up to `summation_tolerance`, taken relative to
    the figure (or, for DIFFERENCE_FIGURES, to 1)."""
    tolerance = summation_tolerance(reference, step, mini_batch)
    for field in UPDATE_FIGURES:
        expected = reference[step][field]
        scale = 1.0 if field in DIFFERENCE_FIGURES else abs(expected)
        assert abs(row[field] - expected) <= tolerance * scale, (step, field, row[field], expected, tolerance)


def sets(settings: list[str]) -> list[str]:
    return [arg for setting in settings for arg in ("--set", setting)]


def spa(args: list[str], cwd: Path, ranks: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    """`spa args` in one process, or under torchrun with `ranks` processes."""
    return subprocess.run(command(args, ranks), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ONE_THREAD}, check=False)


def command(args: list[str], ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", "spa_cli", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(distributed.free_port()), "-m", "spa_cli", *args]


def completed(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def metric_rows(out: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def ppo_args(model: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """--resume from the first run on, so that a rerun after a kill is the very same command."""
    return ["ppo", "--model", str(model), "--out", str(out), "--steps", str(steps), "--resume", "-q",
            *sets([*PPO_SETTINGS, *extra])]


# ---- plans that every rank computes alike ------------------------------------------------------------


def test_split_evenly_gives_contiguous_blocks_the_first_ranks_one_more():
    assert [list(distributed.split_evenly(7, 3, r)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(distributed.split_evenly(4, 2, r)) for r in range(2)] == [[0, 1], [2, 3]]
    assert list(distributed.split_evenly(1, 2, 1)) == []


def fake_samples(lengths: list[int]) -> list[ppo_samples.Sample]:
    return [ppo_samples.Sample(torch.zeros(n, dtype=torch.long), torch.arange(n // 2), *([None] * 5), score=0.0,
                               group=0) for n in lengths]


def test_rank_shares_split_each_mini_batch_evenly_and_balance_tokens():
    samples = fake_samples([10, 50, 20, 40, 30, 30, 5, 5])
    shares = ppo_samples.rank_shares(samples, mini_batch=4, world=2)
    assert shares == [[[0, 1], [2, 3]], [[4, 6], [5, 7]]]  # 60 and 60 tokens; 35 and 35
    assert ppo_samples.rank_shares(samples, mini_batch=4, world=1) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]


def test_rank_micro_batches_pad_with_zero_weight_fillers_to_the_busiest_rank():
    samples = fake_samples([100, 100, 100, 10])
    parts = [samples[:3], samples[3:]]  # rank 0: three passes of 100 tokens (budget 150); rank 1: one
    plans = [ppo_samples.rank_micro_batches(parts, 150, rank) for rank in range(2)]
    assert [len(plan) for plan in plans] == [3, 3]
    assert [weight for _, weight in plans[0]] == [1.0, 1.0, 1.0]
    assert [weight for _, weight in plans[1]] == [1.0, 0.0, 0.0]
    assert all(micro == [[sample] for sample in parts[1]] for micro, _ in plans[1])  # fillers repeat its own pass


# ---- bad launches: one line on every rank, nothing written ----------------------------------------


def launch(args_per_rank: list[list[str]], cwd: Path, world: int, env: dict[str, str] | None = None,
           first_rank: int = 0) -> list[subprocess.Popen]:
    """Start ranks `first_rank`, `first_rank` + 1, ... of a `world`-rank run (one per entry of
    `args_per_rank`) as a launcher would, without one."""
    port = str(distributed.free_port())
    processes = []
    for rank, args in enumerate(args_per_rank, start=first_rank):
        rank_env = {**os.environ, **ONE_THREAD, "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **(env or {})}
        processes.append(subprocess.Popen([sys.executable, "-m", "spa_cli", *args], cwd=cwd, env=rank_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return processes


def finished(processes: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


def assert_one_line(result: subprocess.CompletedProcess, says: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and says in lines[0], lines[0]


def test_bad_launches_end_every_rank_with_one_line_and_write_nothing(tiny_model_dir, tmp_path):
    out = {name: tmp_path / name for name in ("groups", "mini", "config", "alone", "late")}
    cases = {
        # 8 groups over 3 ranks, a mini-batch of 2 over 3 ranks: refused before any process meets
        "groups": ([ppo_args(tiny_model_dir, out["groups"], 1)] * 3, 3, {}),
        "mini": ([ppo_args(tiny_model_dir, out["mini"], 1, "rollout.groups=6", "ppo.mini_batch=2")] * 3, 3, {}),
        # rank 1 with another learning rate
        "config": ([ppo_args(tiny_model_dir, out["config"], 1),
                    ppo_args(tiny_model_dir, out["config"], 1, "ppo.actor_lr=2e-3")], 2, {}),
        # rank 0 of two alone, then rank 1 of two alone: nobody to meet within the start timeout
        "alone": ([ppo_args(tiny_model_dir, out["alone"], 1)], 2, {distributed.START_TIMEOUT_ENV: "3"}),
    }
    started = {name: launch(args, tmp_path, world, env) for name, (args, world, env) in cases.items()}
    started["late"] = launch([ppo_args(tiny_model_dir, out["late"], 1)], tmp_path, 2,
                             {distributed.START_TIMEOUT_ENV: "3"}, first_rank=1)
    results = {name: finished(processes) for name, processes in started.items()}
    for result in results["groups"]:
        assert_one_line(result, "rollout.groups=8 does not split over the 3 ranks the launcher started")
    for result in results["mini"]:
        assert_one_line(result, "ppo.mini_batch=2 does not split over the 3 ranks the launcher started")
    for result in results["config"]:
        assert_one_line(result, f"rank 1 was started with another config than rank 0 (ppo.actor_lr: {LR} -> 0.002)")
    assert_one_line(results["alone"][0], "rank 0 of 2 did not meet the other ranks at 127.0.0.1:")
    assert_one_line(results["late"][0], "rank 1 of 2 did not meet the other ranks at 127.0.0.1:")
    assert not any(path.exists() for path in out.values())


def test_one_process_stages_refuse_a_launcher(tmp_path, monkeypatch):
    from stages import clean, pipeline

    monkeypatch.setenv("WORLD_SIZE", "2")
    config = load_config(None, [f"clean.data={tmp_path / 't.jsonl'}", f"pipeline.dir={tmp_path / 'run'}"])
    for stage in (clean, pipeline):
        with pytest.raises(UserError, match=r"runs in one process, but a launcher started 2 \(WORLD_SIZE=2\)"):
            stage.run(config)
    assert list(tmp_path.iterdir()) == []


# ---- PPO: one process against two ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank(answering_dir, tmp_path_factory) -> Path:
    """One PPO step in one process (DeepSpeed ZeRO-2), validated before and after."""
    cwd = tmp_path_factory.mktemp("ppo-one")
    completed(spa(ppo_args(answering_dir, cwd / "run", 1), cwd))
    return cwd / "run"


@pytest.fixture(scope="module")
def two_ranks(answering_dir, tmp_path_factory) -> Path:
    """Two PPO steps over two ranks under torchrun (ZeRO-2), validated before and after each."""
    cwd = tmp_path_factory.mktemp("ppo-two")
    completed(spa(ppo_args(answering_dir, cwd / "run", 2), cwd, ranks=2))
    return cwd / "run"


def test_two_ranks_keep_the_same_groups_and_make_the_same_update_as_one(one_rank, two_ranks):
    one, two = metric_rows(one_rank)[1], metric_rows(two_ranks)[1]
    for field in EPISODE_FIGURES:
        assert two[field] == one[field], field
    assert_same_update(two, metric_rows(one_rank), 1)
    before = weights(Path(json.loads((one_rank / "manifest.json").read_text())["config"]["model"]["name"]))
    after_one, after_two = weights(one_rank / "final"), weights(two_ranks / "step-1")
    assert max(float((after_one[k] - before[k]).abs().max()) for k in before) > LR / 2  # Adam: about lr a weight
    # the all-reduce sums the ranks' gradients in another order than one process does
    assert_same_weights(after_two, after_one, before, summation_tolerance(metric_rows(one_rank), 1))
    for step in (0, 1):  # validation split over the ranks: the same report
        reports = [json.loads((run / "val" / f"step-{step}.json").read_text()) for run in (one_rank, two_ranks)]
        assert reports[0]["metrics"] == reports[1]["metrics"]


def test_two_ranks_scoring_in_the_update_make_the_update_of_separate_scoring_passes(answering_dir, one_rank,
                                                                                      tmp_path):
    """All 8 kept episodes in one mini-batch: over two ranks each rank's update forward passes give
    its part's values and old log-probs, exchanged before the advantages are whitened over the batch;
    the update equals one process's that scores in separate passes first."""
    runs = {}
    for ranks, in_update in ((2, True), (1, False)):
        runs[ranks] = tmp_path / f"ranks-{ranks}"
        completed(spa(ppo_args(answering_dir, runs[ranks], 1, "ppo.mini_batch=8", "ppo.val_every=0",
                               f"ppo.score_in_update={str(in_update).lower()}"), tmp_path, ranks=ranks))
    two, one = metric_rows(runs[2]), metric_rows(runs[1])
    for field in EPISODE_FIGURES:
        if field in one[1]:
            assert two[1][field] == one[1][field] == metric_rows(one_rank)[1][field], field
    assert two[1]["ppo_kl"] == 0.0  # the old log-probs are the update's own
    assert_same_update(two[1], one, 1, mini_batch=8)
    before = weights(Path(json.loads((runs[1] / "manifest.json").read_text())["config"]["model"]["name"]))
    assert_same_weights(weights(runs[2] / "final"), weights(runs[1] / "final"), before,
                        summation_tolerance(one, 1, mini_batch=8))


def test_a_killed_rank_ends_the_run_and_the_same_command_continues_it(answering_dir, two_ranks, tmp_path):
    """SIGKILL of rank 1 after step 1 is saved: torchrun stops rank 0 (the resume hint), and the
    same command trains step 2 only, ending with the uninterrupted run's weights."""
    out = tmp_path / "run"
    args = ppo_args(answering_dir, out, 2)
    process = subprocess.Popen(command(args, 2), cwd=tmp_path, env={**os.environ, **ONE_THREAD},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while saved_step(out) < 1:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "step 1 was never saved"
        time.sleep(0.02)
    os.kill(rank_pid(process.pid, 1), signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode != 0
    assert "interrupted; run the same command again to resume" in stderr or \
           "another rank of this run stopped, so this one stops too; run the same command again" in stderr, stderr
    assert not (out / "final").exists(), "the run was not cut in the middle"
    first = metric_rows(out)
    completed(spa(args, tmp_path, ranks=2))
    rows, reference = metric_rows(out), metric_rows(two_ranks)
    assert sorted(rows) == [0, 1, 2]
    assert rows[1] == first[1]  # not trained again: the first run's row, timing included
    for field in (*EPISODE_FIGURES, *UPDATE_FIGURES):
        assert rows[2][field] == reference[2][field], field
    final, expected = weights(out / "final"), weights(two_ranks / "final")
    assert all(torch.equal(final[key], expected[key]) for key in expected)


def saved_step(out: Path) -> int:
    try:
        return json.loads((out / "trainer_state" / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of the launcher's child that runs `rank`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no process of rank {rank} under pid {launcher}")


def test_zero3_over_two_ranks_trains_and_samples_like_zero2(answering_dir, two_ranks, tmp_path):
    """ZeRO-3 shards the actor; the rollouts run on an unsharded copy refreshed from the gathered
    weights after every update. The two stages reduce and clip the gradients in partitions of their
    own, so step 1 (same episodes) updates alike up to the rounding of another summation order
    (`summation_tolerance`). Step 2 samples from weights that differ by that rounding, which may flip
    a sampled token, so its episodes are not compared; its sampler agrees with its trainer instead
    (`logp_diff`, the mean over sampled tokens): a refreshed copy differs from the trainer's pass
    by the fp32 rounding of the logits, ~1e-6 per token."""
    completed(spa(ppo_args(answering_dir, tmp_path / "run", 2, "ppo.zero_stage=3"), tmp_path, ranks=2))
    rows, reference = metric_rows(tmp_path / "run"), metric_rows(two_ranks)
    for field in EPISODE_FIGURES:
        assert rows[1][field] == reference[1][field], field
    assert_same_update(rows[1], reference, 1)
    assert rows[2]["logp_diff"] < 1e-5 and reference[2]["logp_diff"] < 1e-5
    before = weights(answering_dir)
    assert_same_weights(weights(tmp_path / "run" / "step-1"), weights(two_ranks / "step-1"), before,
                        summation_tolerance(reference, 1))


def test_episodes_weighed_alike_over_two_ranks_make_the_one_process_update(answering_dir, one_rank, tmp_path):
    """``ppo.loss_agg=seq-mean-token-mean`` (the paper configs'): each rank weighs its episodes,
    of unequal lengths, by the episode count of the whole mini-batch, so two ranks update as one
    process does (`summation_tolerance`). The same episodes aggregated as a token mean (`one_rank`)
    update the weights apart by more than that tolerance: the weighting is what is compared."""
    per_episode = ["ppo.loss_agg=seq-mean-token-mean"]
    one, two = tmp_path / "one", tmp_path / "two"
    completed(spa(ppo_args(answering_dir, one, 1, *per_episode), tmp_path))
    completed(spa(ppo_args(answering_dir, two, 1, *per_episode), tmp_path, ranks=2))
    reference, rows = metric_rows(one), metric_rows(two)
    for field in EPISODE_FIGURES:
        assert rows[1][field] == reference[1][field] == metric_rows(one_rank)[1][field], field
    assert_same_update(rows[1], reference, 1)
    before, tolerance = weights(answering_dir), summation_tolerance(reference, 1)
    assert_same_weights(weights(two / "final"), weights(one / "final"), before, tolerance)
    with pytest.raises(AssertionError):
        assert_same_weights(weights(one_rank / "final"), weights(one / "final"), before, tolerance)


def sft_rows(turns: list[int]) -> list[dict]:
    """SFT rows of ``turns[i]`` assistant turns each: rows of unequal lengths."""
    rows = []
    for i, count in enumerate(turns):
        messages = [{"role": "system", "content": "Solve the puzzle. Think, then answer."}]
        for t in range(count):
            move = ("Left", "Up", "Right")[(i + t) % 3]
            messages += [{"role": "user", "content": f"Puzzle {i}, turn {t + 1}: the player stands at ({i}, {t})."},
                         {"role": "assistant", "content": f"<think> I go {move}. </think> <answer> {move} </answer>"}]
        rows.append({"id": f"row-{i}", "messages": messages})
    return rows


def test_sft_rows_weighed_alike_over_two_ranks_step_as_one_process(tokenizer, tiny_model_dir, tmp_path):
    """``sft.loss_agg=seq-mean-token-mean`` over two ranks holding unequal numbers of rows of
    unequal lengths: every step's gradient norm is the one-batch aggregate's (computed here from
    each row alone), and the loss and weights are one process's, up to the rounding of another
    summation order over the step's tokens. Ranks that averaged their own aggregates would give a
    gradient norm off by far more than that tolerance."""
    from transformers import AutoModelForCausalLM

    from stages.common.kernels.attention import register_spa_sdpa
    from stages.sft import token_ce
    from stages.training.policy import StepPolicy
    from stages.training.sft_data import collate, epoch_steps, step_plan, tokenize_rows

    rows = sft_rows([4, 1, 1, 1, 1])
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    examples, _ = tokenize_rows(rows, tokenizer, max_length=2048)
    step = [examples[i] for i in epoch_steps(len(examples), 0, seed=1, global_batch=len(examples))[0]]
    parts = [[step[r] for mb in plan for r in mb.rows] for plan in step_plan(step, 2, 4096, share=True)]
    assert len(parts[0]) != len(parts[1])

    register_spa_sdpa()  # as load_model does
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    policy = StepPolicy(model, temperature=1.0)

    def grad_norm(batches: list[list]) -> float:
        """The norm of the gradient of the mean over `batches` of each one's aggregate."""
        model.zero_grad()
        for batch in batches:
            losses = [token_ce(policy, collate([example])) for example in batch]
            (aggregate_by_definition("seq-mean-token-mean", losses, 0) / len(batches)).backward()
        return float(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm())

    expected, averaged_over_ranks = grad_norm([step]), grad_norm(parts)
    args = ["sft", "--data", str(data), "--model", str(tiny_model_dir), "-q",
            *sets(["sft.epochs=2", f"sft.global_batch={len(rows)}", f"sft.lr={LR}", "sft.warmup_ratio=0",
                   "sft.loss_agg=seq-mean-token-mean", "sft.zero_stage=2"])]
    one, two = tmp_path / "one", tmp_path / "two"
    completed(spa([*args, "--out", str(one)], tmp_path))
    completed(spa([*args, "--out", str(two)], tmp_path, ranks=2))
    reference, metrics = metric_rows(one), metric_rows(two)
    tolerance = reference[1]["tokens"] * UNIT_ROUNDOFF  # one step's sums over its tokens
    assert abs(averaged_over_ranks - expected) > 100 * tolerance * expected
    for run in (reference, metrics):
        assert abs(run[1]["grad_norm"] - expected) <= tolerance * expected, (run[1]["grad_norm"], expected)
    for field in ("loss", "grad_norm"):  # step 2: after one update, the rounding of two steps
        assert abs(metrics[2][field] - reference[2][field]) <= 2 * tolerance * reference[2][field], field
    assert_same_weights(weights(two / "final"), weights(one / "final"), weights(tiny_model_dir), 2 * tolerance)


# ---- eval and generate: seeds split over the ranks -------------------------------------------------


def same_lines(a: Path, b: Path) -> bool:
    return sorted(a.read_text().splitlines()) == sorted(b.read_text().splitlines())


def test_eval_over_two_ranks_writes_the_one_process_report(answering_dir, tmp_path):
    """3 seeds over 2 ranks (2 + 1): one report, one trajectory file, as one process writes them."""
    args = ["eval", "--model", str(answering_dir), "--env", "frozen_lake", "--seeds", "3", "--pass-k", "2",
            *sets(["rollout.max_turns=1", "rollout.max_new_tokens=16", "rollout.batch_size=2"])]
    one, two = tmp_path / "one", tmp_path / "two"
    completed(spa([*args, "--out", str(one / "report.json")], tmp_path))
    result = spa([*args, "--out", str(two / "report.json")], tmp_path, ranks=2)
    completed(result)
    reports = [json.loads((d / "report.json").read_text()) for d in (one, two)]
    assert reports[0]["settings"] == reports[1]["settings"] and reports[0]["metrics"] == reports[1]["metrics"]
    assert reports[0]["per_seed"] == reports[1]["per_seed"]
    assert same_lines(one / "report.trajectories.jsonl", two / "report.trajectories.jsonl")
    assert sorted(p.name for p in two.iterdir()) == ["report.json", "report.json.manifest.json",
                                                      "report.trajectories.jsonl"]
    assert result.stdout.count("Pass@1") == 1  # rank 0 prints the table


def test_generate_over_two_ranks_writes_the_one_process_episodes(answering_dir, tmp_path):
    args = ["generate", "--model", str(answering_dir), "--env", "frozen_lake", "--groups", "3", "--group-size",
            "2", "-q", *sets(["generate.prompt_mode=base", "rollout.max_turns=2", "rollout.max_new_tokens=16",
                              "rollout.batch_size=2"])]
    completed(spa([*args, "--out", str(tmp_path / "one.jsonl")], tmp_path))
    completed(spa([*args, "--out", str(tmp_path / "two.jsonl")], tmp_path, ranks=2))
    assert same_lines(tmp_path / "one.jsonl", tmp_path / "two.jsonl")
    assert len((tmp_path / "two.jsonl").read_text().splitlines()) == 6
    summaries = [json.loads((tmp_path / f"{n}.jsonl.manifest.json").read_text())["summary"] for n in ("one", "two")]
    for key in ("episodes", "new_episodes", "success_rate", "format_ok_rate", "mean_turns", "mean_reward", "tokens"):
        assert summaries[0][key] == summaries[1][key], key
