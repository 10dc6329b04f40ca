"""`spa eval seeds`: B minus A over several training runs of each (RL seeds), pooled per puzzle,
with every run's own difference and the verdict, on hand-made reports of closed-form figures."""

import json

import pytest
from test_cli import invoke
from test_evaluate import write_report

from stages.common.errors import UserError
from stages.evaluation import metrics, reports, tables

PUZZLES = (123, 124, 125, 126)


def run(tmp_path, name, successes, n=2):
    """A report of 2 samples on each of the four puzzles, with these successes (one count each)."""
    per_seed = [{"seed": seed, "n": n, "successes": c} for seed, c in zip(PUZZLES, successes, strict=True)]
    pass1 = sum(successes) / (n * len(PUZZLES))
    return write_report(tmp_path, name, pass1, 0.0, per_seed=per_seed, n=n, k=n, seeds=len(PUZZLES))


def per_seed(successes, n=2):
    return [{"seed": seed, "n": n, "successes": c} for seed, c in zip(PUZZLES, successes, strict=True)]


def test_the_pooled_difference_averages_each_sides_runs_on_each_puzzle():
    # B's runs solve 1, 2 and 1 of 2 on every puzzle, A none: 2/3 a puzzle, the same on every puzzle,
    # so every resample of the puzzles gives the mean itself
    b_runs = [per_seed([1] * 4), per_seed([2] * 4), per_seed([1] * 4)]
    diff, low, high = metrics.pooled_difference([per_seed([0] * 4)], b_runs, 1)
    assert (diff, low, high) == pytest.approx((2 / 3,) * 3, rel=1e-12)
    # Pass@2: B's runs solve every puzzle at least once in two samples
    assert metrics.pooled_difference([per_seed([0] * 4)], b_runs, 2) == pytest.approx((1.0,) * 3, rel=1e-12)
    # one run a side is the paired difference
    one = ([per_seed([0, 1, 0, 2])], [per_seed([1, 1, 2, 0])])
    assert metrics.pooled_difference(*one, 1) == metrics.paired_difference(one[0][0], one[1][0], 1)
    # A's runs are averaged too: (0 + 1) / 2 of 2 samples = 1/4 a puzzle, against B's 1/2
    assert metrics.pooled_difference([per_seed([0] * 4), per_seed([1] * 4)], [per_seed([1] * 4)], 1) == \
        pytest.approx((0.25,) * 3, rel=1e-12)


def test_the_pooled_difference_needs_puzzles_every_run_shares_with_k_samples():
    other_puzzles = [{"seed": 999, "n": 2, "successes": 1}]
    assert metrics.pooled_difference([per_seed([0] * 4)], [per_seed([1] * 4), other_puzzles], 1) is None
    assert metrics.pooled_difference([per_seed([0] * 4)], [per_seed([1] * 4)], 3) is None


@pytest.mark.parametrize(("pooled", "runs", "verdict"), [
    ((0.1, 0.02, 0.2), [0.05, 0.1, 0.15], "higher"),
    ((-0.1, -0.2, -0.02), [-0.05, -0.1, -0.15], "lower"),
    ((0.1, -0.01, 0.2), [0.05, 0.1, 0.15], "not shown"),  # the interval holds 0
    ((0.1, 0.02, 0.2), [0.05, -0.01, 0.15], "not shown"),  # a run flips
    ((0.1, 0.02, 0.2), [0.05, 0.0, 0.15], "not shown"),  # a run shows no difference
    (None, [], "not shown"),
])
def test_the_verdict_holds_only_when_the_interval_excludes_0_and_no_run_disagrees(pooled, runs, verdict):
    assert metrics.seed_verdict(pooled, runs) == verdict


def test_seed_comparison_gives_every_run_its_difference_from_the_other_side(tmp_path):
    a = [run(tmp_path, "sft.json", [0, 0, 0, 0])]
    b = [run(tmp_path, f"rl{i}.json", successes) for i, successes in enumerate(([1] * 4, [2] * 4, [0] * 4))]
    comparison = reports.seed_comparison(a, b)
    assert comparison["k"] == 2 and list(comparison["figures"]) == ["pass@1", "pass@2"]
    figure = comparison["figures"]["pass@1"]
    assert [(r["side"], r["report"], r["pass"]) for r in figure["runs"]] == [
        ("A", str(a[0]), 0.0), ("B", str(b[0]), 0.5), ("B", str(b[1]), 1.0), ("B", str(b[2]), 0.0)]
    # A's run against B's three (1/2 a puzzle), each B run against A's one
    assert [r["difference"] for r in figure["runs"]] == [pytest.approx((0.5,) * 3, rel=1e-12), (0.5,) * 3,
                                                         (1.0,) * 3, (0.0,) * 3]
    assert figure["pooled"] == pytest.approx((0.5,) * 3, rel=1e-12)
    assert figure["verdict"] == "not shown"  # the third run learnt nothing
    headers, cells = tables.seed_cells(comparison)
    assert headers == ("side", "report", "Pass@1", "B minus A, Pass@1 [95%]", "Pass@2", "B minus A, Pass@2 [95%]")
    assert cells[1] == ("B", str(b[0]), "50.0", "+50.0 [+50.0, +50.0]", "100.0", "+100.0 [+100.0, +100.0]")
    assert cells[-2:] == [("A, B", "pooled", "", "+50.0 [+50.0, +50.0]", "", "+66.7 [+66.7, +66.7]"),
                          ("", "verdict: B is", "", "not shown", "", "not shown")]


def test_a_runs_flip_on_either_side_leaves_it_not_shown_and_agreement_shows_it(tmp_path):
    a = [run(tmp_path, "a0.json", [0, 0, 0, 0]), run(tmp_path, "a1.json", [2, 2, 2, 2])]
    b = [run(tmp_path, "b0.json", [1, 1, 1, 1])]
    figure = reports.seed_comparison(a, b)["figures"]["pass@1"]
    # B is above A's first run and below its second; pooled 1/2 - 1/2 = 0
    assert [r["difference"][0] for r in figure["runs"]] == [0.5, -0.5, pytest.approx(0.0, abs=1e-15)]
    assert figure["verdict"] == "not shown"
    agreeing = reports.seed_comparison([run(tmp_path, "a.json", [0, 0, 0, 0])],
                                       [b[0], run(tmp_path, "b1.json", [2, 2, 2, 2])])
    assert agreeing["figures"]["pass@1"]["verdict"] == agreeing["figures"]["pass@2"]["verdict"] == "higher"


def test_reports_of_other_settings_or_a_side_without_reports_are_refused(tmp_path):
    a = run(tmp_path, "a.json", [0, 0, 0, 0])
    other = write_report(tmp_path, "other.json", 0.5, 0.5, per_seed=per_seed([1] * 4), n=2, k=2, seeds=4,
                         temperature=0.7)
    with pytest.raises(UserError, match="temperature=0.7"):
        reports.seed_comparison([a], [other])
    with pytest.raises(UserError, match="at least one report on each side"):
        reports.seed_comparison([a], [])


def test_the_command_prints_json_markdown_and_a_table(tmp_path):
    a = run(tmp_path, "a.json", [0, 0, 0, 0])
    b = [run(tmp_path, "b0.json", [1, 1, 1, 1]), run(tmp_path, "b1.json", [2, 2, 2, 2])]
    args = ["eval", "seeds", "--a", str(a), "--b", str(b[0]), "--b", str(b[1])]
    result = invoke(*args, "--json")
    assert result.exit_code == 0
    assert json.loads(result.output) == json.loads(json.dumps(reports.seed_comparison([a], b)))
    markdown = invoke(*args, "--format", "markdown").output
    assert markdown == tables.markdown_table(*tables.seed_cells(reports.seed_comparison([a], b)))
    table = invoke(*args).output
    assert "spa eval seeds" in table and "higher" in table and str(b[1].name) in table
    refused = invoke("eval", "seeds", "--a", str(a), "--b", str(tmp_path / "missing.json"))
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    one_side = invoke("eval", "seeds", "--b", str(a))
    assert one_side.exit_code == 2 and "at least one report on each side" in one_side.output
