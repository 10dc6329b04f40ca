"""The `spa` command line: one thin command per stage of the SPA recipe.

Every stage command reads the YAML config given by `--config`, applies the repeatable
`--set section.key=value` overrides and then its own flags (which are shorthands for config keys),
and calls the stage's `run(config)`. A flag's `--help` names the config key it sets and that key's
built-in default (`_flag`). Errors a user can cause are printed as one line and exit with code 2.
Stages are imported lazily so `spa --help`, `spa envs` and shell completion stay fast.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

# Stages draw their own rich progress; transformers' tqdm bars on every model load and save
# ("Loading weights", "Writing model shards") would interleave with it. A user's setting wins.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# The UsageError of the click that typer runs on (recent typers vendor their own copy and export
# only BadParameter from it); every bad flag raises one.
_UsageError = typer.BadParameter.__mro__[1]


#: `spa --help` lists the commands in the order of the recipe, then what looks at runs, then helpers.
COMMAND_PANELS = {
    "Recipe stages": ("generate", "clean", "sft", "ppo", "eval", "pipeline"),
    "Looking at runs": ("probe", "plot", "view"),
    "Helpers": ("plan", "envs", "play", "config"),
}
COMMAND_ORDER = [name for names in COMMAND_PANELS.values() for name in names]


class _SpaGroup(TyperGroup):
    """The root command. Its help lists the commands in the panels and order of `COMMAND_PANELS`,
    and every help text of the app (commands and flags, sub-commands included) is reflowed once,
    here (`reflow`), so that it wraps where the terminal does, not where a docstring's lines end.

    Click reports a bad flag (an unknown option, `--groups abc`) in a framed box under the usage
    line; spa reports it in one line, like its other user errors. Subcommands are parsed inside the
    root's invoke, so the root covers them all."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _reflow_help(self)
        for panel, names in COMMAND_PANELS.items():
            for name in names:
                self.commands[name].rich_help_panel = panel

    def list_commands(self, ctx: Any) -> list[str]:
        return sorted(super().list_commands(ctx), key=COMMAND_ORDER.index)

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with _usage_errors_in_one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with _usage_errors_in_one_line():
            return super().invoke(ctx)


def reflow(text: str) -> str:
    """`text` with each paragraph (blank-line separated) on one line, for the terminal to wrap."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text))
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def _reflow_help(command: Any) -> None:
    """Reflow the help of `command`, of its flags and of its sub-commands."""
    if command.help:
        command.help = reflow(command.help)
    for param in command.params:
        if getattr(param, "help", None):
            param.help = reflow(param.help)
    for sub in getattr(command, "commands", {}).values():
        _reflow_help(sub)


@contextlib.contextmanager
def _usage_errors_in_one_line():
    try:
        yield
    except _UsageError as err:
        if type(err).__name__ == "NoArgsIsHelpError":
            raise  # `spa` alone prints the help
        where = f" (see `{err.ctx.command_path} --help`)" if err.ctx else ""
        _fail(err.format_message() + where)


app = typer.Typer(
    name="spa",
    cls=_SpaGroup,
    help="SPA: world-model self-play finetuning for agentic RL (arXiv 2510.15047).\n\n"
         "Each stage reads the built-in defaults, then a YAML config (--config), then --set overrides, then "
         "its own flags; `spa pipeline` runs the stages one after the other.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="The configuration: the resolved settings, and the reference of every key.",
                         no_args_is_help=True)
app.add_typer(config_app, name="config")
eval_app = typer.Typer()  # its help is eval_'s docstring
app.add_typer(eval_app, name="eval")

console = Console()
err_console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        try:
            version = metadata.version("spa")
        except metadata.PackageNotFoundError:  # run from a source tree that was never installed
            version = "unknown (not installed)"
        typer.echo(f"spa {version}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool | None, typer.Option("--version", callback=_version, is_eager=True,
                                                 help="Print spa's version and exit.")] = None,
) -> None:
    pass


def _flag(key: str, help: str, *names: str) -> Any:
    """An option that sets config key `key` (None when not given: the config decides); its --help
    shows the key and the built-in default it resolves to when neither --config nor --set sets it."""
    from stages.common.config import default_of, yaml_text

    return typer.Option(*names, help=help, show_default=f"{key}: {yaml_text(default_of(key))}")


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file.",
                                                show_default="none: the built-in defaults, configs/base.yaml")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="Override: section.key=value (repeatable).",
                                                  show_default="none")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress and no status lines.",
                                        show_default="quiet: false")]
EnvOpt = Annotated[str | None, _flag("env.name", "Game name (see `spa envs`).", "--env", "-e")]
ModelOpt = Annotated[str | None, _flag("model.name", "smollm2-135m, a model directory, or a hub id.", "--model", "-m")]
BackendOpt = Annotated[str | None, _flag("rollout.backend", "hf | vllm | random.", "--backend", "-b")]
ReportToOpt = Annotated[list[str] | None, _flag(
    "tracking.report_to", "none | tensorboard | wandb (repeatable): trackers that also get the per-step "
    "figures and the config.", "--report-to")]


def _out(section: str, what: str) -> Any:
    return _flag(f"{section}.out", what, "--out", "-o")


def _resume(section: str) -> Any:
    return _flag(f"{section}.resume", "Continue the run already at --out (same settings only).")


def _prompt_mode(section: str) -> Any:
    return _flag(f"{section}.prompt_mode", "world_model | base: the prompt the agent is shown.")


def _render_mode(section: str) -> Any:
    return _flag(f"{section}.render_mode", "coords | text: states with or without coordinates.")


#: OSErrors that a path or the machine's state causes, not a bug, and what to do about each.
OS_ERROR_FIXES = {
    errno.ENOSPC: "free some space, then run the same command again",
    errno.EDQUOT: "free some space, then run the same command again",
    errno.EACCES: "fix its permissions or choose another path",
    errno.EROFS: "choose a path on a writable filesystem",
    errno.ENOTDIR: "a part of the path is a file; choose another path",
    errno.EISDIR: "it is a directory; give a file path",
    errno.ENAMETOOLONG: "choose a shorter path",
}


def user_errors(command: Callable) -> Callable:
    """Turn user-caused errors into one line on stderr and exit code 2 (no traceback)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from stages.common import distributed

        try:
            result = _reporting_errors(command, args, kwargs)
        except KeyboardInterrupt:
            # Ctrl-C, or a launcher's SIGTERM (`distributed._stop_on_sigterm`), which can also land
            # while an error below is being reported (a rank that lost its peer is stopped by the
            # launcher at that moment): either way the stage can be resumed, and says so
            _stop_resumably("interrupted", kwargs)
        distributed.exit_rank()
        return result

    return wrapper


def _reporting_errors(command: Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
    from envs import EnvError
    from stages.common import distributed
    from stages.common.errors import UserError

    try:
        result = command(*args, **kwargs)
        distributed.wait_for_all_ranks()
        return result
    except (UserError, EnvError) as err:
        _fail(str(err))
    except OSError as err:
        if err.errno not in OS_ERROR_FIXES:
            raise
        where = f": {err.filename}" if err.filename else ""
        _fail(f"{err.strerror}{where}; {OS_ERROR_FIXES[err.errno]}")
    except Exception as err:
        if not distributed.lost_peer(err):
            raise
        _stop_resumably("another rank of this run stopped, so this one stops too", kwargs)


def _stop_resumably(what: str, kwargs: dict[str, Any]) -> None:
    """End a stage that can be resumed (exit 130), saying how."""
    again = "again with --resume" if "resume" in kwargs and not kwargs["resume"] else "again"  # only when told to
    _error_line(f"{what}; run the same command {again} to resume")
    raise typer.Exit(130) from None


def _main_rank() -> bool:
    """Rank 0 of a launched run (or the only process) prints the results."""
    from stages.common.distributed import launched_rank

    return launched_rank() == 0


def _fail(message: str) -> None:
    _error_line(f"error: {message}")
    raise typer.Exit(2)


def _error_line(text: str) -> None:
    """`text` on stderr as written, on one line whatever the terminal's width (scripts and tests
    match these lines)."""
    err_console.print(text, highlight=False, markup=False, soft_wrap=True)


def _load(config: Path | None, sets: list[str] | None, quiet: bool, **flags: Any):
    """The config from file, --set overrides, then the command's own flags (None = not given)."""
    from stages.common.config import load_config

    values = {key.replace("__", "."): value for key, value in flags.items() if value is not None}
    if quiet:
        values["quiet"] = True
    return load_config(config, sets or [], values)


# ---- stages -----------------------------------------------------------------------------------


@app.command()
@user_errors
def generate(
    config: ConfigOpt = None, set_: SetOpt = None, quiet: QuietOpt = False,
    env: EnvOpt = None, model: ModelOpt = None, backend: BackendOpt = None,
    groups: Annotated[int | None, _flag("rollout.groups", "Puzzles (seed groups).")] = None,
    group_size: Annotated[int | None, _flag("rollout.group_size", "Episodes per puzzle.")] = None,
    seed: Annotated[int | None, _flag("rollout.seed", "First seed.")] = None,
    prompt_mode: Annotated[str | None, _prompt_mode("generate")] = None,
    render_mode: Annotated[str | None, _render_mode("generate")] = None,
    out: Annotated[str | None, _out("generate", "trajectories.jsonl to write.")] = None,
    resume: Annotated[bool | None, _resume("generate")] = None,
) -> None:
    """Play the game with a model and write its episodes to trajectories.jsonl (self-play data).

    rollout.groups puzzles x rollout.group_size episodes of up to rollout.max_turns turns each.
    Every episode is appended as it finishes, so --resume continues a stopped run."""
    from stages import generate as stage

    cfg = _load(config, set_, quiet, env__name=env, model__name=model, rollout__backend=backend,
                rollout__groups=groups, rollout__group_size=group_size, rollout__seed=seed,
                generate__prompt_mode=prompt_mode, generate__render_mode=render_mode, generate__out=out,
                generate__resume=resume)
    stage.run(cfg)


@app.command()
@user_errors
def clean(
    config: ConfigOpt = None, set_: SetOpt = None, quiet: QuietOpt = False,
    data: Annotated[str | None, _flag(
        "clean.data", "trajectories.jsonl from `spa generate`, or SPA's wm_train.parquet / hub dataset id.")] = None,
    out: Annotated[str | None, _out("clean", "sft.jsonl to write (and its .val.jsonl).")] = None,
    unit: Annotated[str | None, _flag("clean.unit", "trajectory | turn.")] = None,
    states: Annotated[str | None, _flag("clean.states", "ground_truth | self_belief.")] = None,
    random_coordinates: Annotated[bool | None, _flag("clean.random_coordinates",
                                                     "Random coordinates (ablation).")] = None,
    success_only: Annotated[bool | None, _flag("clean.success_only", "Keep successful episodes only.")] = None,
    base_prompt_fraction: Annotated[float | None, _flag(
        "clean.base_prompt_fraction", "Share of the trajectories shown with the base prompt, states kept.")] = None,
    skip_bad: Annotated[bool | None, _flag("clean.skip_bad", "Skip unreadable lines instead of stopping.")] = None,
) -> None:
    """Turn trajectories into SFT rows with the true states: trajectories.jsonl -> sft.jsonl.

    The model's observations and predictions are replaced by the game's states (clean.states), the
    filters are applied, and a validation split is written beside the rows (sft.val.jsonl)."""
    from stages import clean as stage

    cfg = _load(config, set_, quiet, clean__data=data, clean__out=out, clean__unit=unit, clean__states=states,
                clean__random_coordinates=random_coordinates, clean__success_only=success_only,
                clean__base_prompt_fraction=base_prompt_fraction, clean__skip_bad=skip_bad)
    stage.run(cfg)


@app.command()
@user_errors
def sft(
    config: ConfigOpt = None, set_: SetOpt = None, quiet: QuietOpt = False,
    data: Annotated[str | None, _flag(
        "sft.data", "sft.jsonl from `spa clean`, or SPA's wm_train.parquet, or a hub dataset id.")] = None,
    model: ModelOpt = None,
    out: Annotated[str | None, _out("sft", "Run directory to write.")] = None,
    epochs: Annotated[int | None, _flag("sft.epochs", "Training epochs.")] = None,
    state_text: Annotated[str | None, _flag(
        "sft.state_text", "trained | masked (the paper's [MASKED] ablation, Fig. 4) | placeholder (the format control).")] = None,
    report_to: ReportToOpt = None,
    resume: Annotated[bool | None, _resume("sft")] = None,
    dry_run: Annotated[bool, typer.Option(help="Write the first rows' tokens and masks, do not train.")] = False,
) -> None:
    """Fine-tune a model on sft.jsonl (world-model SFT) into a checkpoint directory.

    Trains with DeepSpeed ZeRO, on the CPU too; --data also takes SPA's released wm_train.parquet."""
    from stages import sft as stage

    cfg = _load(config, set_, quiet, sft__data=data, model__name=model, sft__out=out, sft__epochs=epochs,
                sft__state_text=state_text, tracking__report_to=report_to, sft__resume=resume)
    stage.run(cfg, dry_run=dry_run)


@app.command()
@user_errors
def ppo(
    config: ConfigOpt = None, set_: SetOpt = None, quiet: QuietOpt = False,
    model: ModelOpt = None, env: EnvOpt = None,
    out: Annotated[str | None, _out("ppo", "Run directory to write.")] = None,
    steps: Annotated[int | None, _flag("ppo.steps", "PPO steps.")] = None,
    prompt_mode: Annotated[str | None, _prompt_mode("ppo")] = None,
    render_mode: Annotated[str | None, _render_mode("ppo")] = None,
    report_to: ReportToOpt = None,
    resume: Annotated[bool | None, _resume("ppo")] = None,
) -> None:
    """Train a model on the game with multi-turn PPO into a checkpoint directory.

    Each step plays fresh puzzles with the live model, then updates it with a critic and GAE (or the
    advantage ppo.advantage names); validation Pass@k every ppo.val_every steps."""
    from stages import ppo as stage

    cfg = _load(config, set_, quiet, model__name=model, env__name=env, ppo__out=out, ppo__steps=steps,
                ppo__prompt_mode=prompt_mode, ppo__render_mode=render_mode, tracking__report_to=report_to,
                ppo__resume=resume)
    stage.run(cfg)


@eval_app.callback(invoke_without_command=True)
@user_errors
def eval_(
    ctx: typer.Context,
    config: ConfigOpt = None, set_: SetOpt = None, quiet: QuietOpt = False,
    model: ModelOpt = None, env: EnvOpt = None, backend: BackendOpt = None,
    pass_k: Annotated[int | None, _flag("eval.pass_k", "Largest k of Pass@k.", "--pass-k", "-k")] = None,
    seeds: Annotated[int | None, _flag("eval.seeds", "Number of eval puzzles (seeds from eval.first_seed).")] = None,
    n: Annotated[int | None, _flag("eval.n", "Samples per puzzle (null: k).", "--n")] = None,
    temperature: Annotated[float | None, _flag("rollout.temperature", "Sampling temperature.")] = None,
    prompt_mode: Annotated[str | None, _prompt_mode("eval")] = None,
    render_mode: Annotated[str | None, _render_mode("eval")] = None,
    state_ppl: Annotated[bool | None, _flag("eval.state_ppl", "Also measure state perplexity.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Draw Pass@k against k into this PNG.",
                                              show_default="none")] = None,
    out: Annotated[str | None, _out("eval", "report.json to write (and its .trajectories.jsonl).")] = None,
    resume: Annotated[bool | None, _resume("eval")] = None,
) -> None:
    """Measure a model on fixed puzzles: Pass@k, world-model accuracy, state perplexity -> report.json.

    Every eval of the same settings plays the same puzzles (eval.seeds from eval.first_seed), each
    eval.n times; the episodes go to report.trajectories.jsonl as they finish."""
    if ctx.invoked_subcommand is not None:
        return
    from stages import evaluate as stage
    from stages.evaluation import plots, tables

    if plot is not None:
        plots.check_plot(plot)  # before the eval, not after its minutes of work
    cfg = _load(config, set_, quiet, model__name=model, env__name=env, rollout__backend=backend,
                eval__pass_k=pass_k, eval__seeds=seeds, eval__n=n, rollout__temperature=temperature,
                eval__prompt_mode=prompt_mode, eval__render_mode=render_mode, eval__state_ppl=state_ppl,
                eval__out=out, eval__resume=resume)
    report = stage.run(cfg)
    if _main_rank():  # under a launcher every rank returns the report; one prints it
        tables.print_report(report)
        if plot is not None:
            plots.plot_pass_at_k(report, plot)


FormatOpt = Annotated[str, typer.Option("--format", "-f", help="table | json | markdown.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Same as --format json.", show_default="false")]


def _output_format(format_: str, as_json: bool) -> str:
    if format_ not in ("table", "json", "markdown"):
        _fail(f"--format must be table, json or markdown, got {format_!r}")
    return "json" if as_json else format_


@eval_app.command("seeds")
@user_errors
def eval_seeds(
    a: Annotated[list[Path] | None, typer.Option("--a", help="A's report.json files: one, or one per run (RL seed).",
                                                  show_default="none")] = None,
    b: Annotated[list[Path] | None, typer.Option("--b", help="B's report.json files: one, or one per run (RL seed).",
                                                  show_default="none")] = None,
    force: Annotated[bool, typer.Option(help="Compare even if the settings differ.")] = False,
    format_: FormatOpt = "table", as_json: JsonOpt = False,
) -> None:
    """B minus A over several training runs of each (RL seeds): does the difference hold in all?

    Every run's Pass@1 and Pass@k in percent, with B minus A for it against all runs of the other
    side; then the pooled difference (each side's mean over its runs, puzzle by puzzle) with a 95%
    interval over the puzzles.

    The verdict: higher or lower when that interval excludes 0 and no run's difference has the
    other sign, else not shown. --json gives the same figures as fractions."""
    from stages.evaluation import reports as eval_reports
    from stages.evaluation import tables

    shape = _output_format(format_, as_json)
    comparison = eval_reports.seed_comparison(a or [], b or [], force=force)
    if shape == "json":
        typer.echo(json.dumps(comparison, indent=2))
    elif shape == "markdown":
        typer.echo(tables.markdown_table(*tables.seed_cells(comparison)), nl=False)
    else:
        _print_table("spa eval seeds: B minus A (%)", *tables.seed_cells(comparison))


@eval_app.command("compare")
@user_errors
def eval_compare(
    reports: Annotated[list[Path], typer.Argument(help="report.json files from `spa eval`, or probe.json "
                                                       "files from `spa probe`.")],
    force: Annotated[bool, typer.Option(help="Compare even if the settings differ.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Draw the reports' Pass@k curves, with 95% bands, into "
                                              "this PNG.", show_default="none")] = None,
    format_: FormatOpt = "table", as_json: JsonOpt = False,
) -> None:
    """Print several eval reports side by side, like the paper's Table 2, or several probe reports.

    Each report's Pass@1 and Pass@k in percent, and its difference from the first report's with a
    95% interval; --json gives the same figures as fractions, --format markdown as a table. Probe
    reports show each model's exact and cell accuracy where the action changes the state, how
    often it finds the true next state more likely than the copy, and exact per kind of action."""
    from stages import probe as stage_probe
    from stages.evaluation import plots, tables
    from stages.evaluation import reports as eval_reports

    shape = _output_format(format_, as_json)
    probes = [stage_probe.is_report(path) for path in reports]
    if any(probes):
        if not all(probes):
            _fail("the reports mix spa probe and spa eval reports; compare one kind at a time")
        if plot is not None:
            _fail("--plot draws Pass@k curves, which probe reports do not have; leave it out")
        rows = stage_probe.compare_rows(reports, force=force)
        if shape == "json":
            typer.echo(json.dumps(rows, indent=2))
        elif shape == "markdown":
            typer.echo(tables.markdown_table(*stage_probe.compare_cells(rows)), nl=False)
        else:
            _print_table(f"spa probe: {rows[0]['env']} (%)", *stage_probe.compare_cells(rows))
        return
    if plot is not None:
        plots.check_plot(plot)
    rows = eval_reports.compare_rows(reports, force=force)
    if shape == "json":
        typer.echo(json.dumps(rows, indent=2))
    elif shape == "markdown":
        typer.echo(tables.compare_markdown(rows), nl=False)
    else:
        tables.print_wide(tables.compare_table(rows), console)
    if plot is not None:
        plots.plot_pass_at_k([eval_reports.load_report(path) for path in reports], plot, [str(p) for p in reports])


@app.command()
@user_errors
def pipeline(
    config: ConfigOpt = None, set_: SetOpt = None, quiet: QuietOpt = False,
    run_dir: Annotated[str | None, _flag("pipeline.dir", "Run directory.", "--dir")] = None,
    report_to: ReportToOpt = None,
    dry_run: Annotated[bool, typer.Option(help="Print the plan (stages, arms, models, modes, sizes, memory "
                                          "per GPU); run and write nothing.", show_default="false")] = False,
    json_: Annotated[bool, typer.Option("--json", help="With --dry-run: the plan as JSON.",
                                        show_default="false")] = False,
) -> None:
    """Run the paper's arms end to end (generate, clean, sft, ppo, eval) in one run directory.

    A rerun skips the stages that completed and continues an interrupted one; --dry-run prints the
    plan."""
    from stages import pipeline as stage

    cfg = _load(config, set_, quiet, pipeline__dir=run_dir, tracking__report_to=report_to)
    if json_ and not dry_run:
        _fail("--json prints the plan; use it with --dry-run")
    if dry_run:
        plan = stage.plan(cfg)
        if json_:
            typer.echo(json.dumps(plan.to_json(), indent=2))
        else:
            console.print(stage.describe(plan), highlight=False, markup=False, soft_wrap=True)
        error = stage.memory_error(stage.memory_plans(plan))
        if error:  # what the run would refuse on a GPU of this size
            _fail(error)
        return
    stage.run(cfg)


@app.command("plan")
@user_errors
def plan_(
    config: Annotated[Path, typer.Argument(help="YAML config file (a pipeline's, or a stage's with --stage).")],
    set_: SetOpt = None,
    gpus: Annotated[int, typer.Option(help="GPUs each stage runs on (a launcher's ranks).")] = 1,
    gpu_memory: Annotated[float | None, typer.Option(
        help="GiB of one GPU.", show_default="the GPU here, else 79.2: an 80 GB A100 or H100")] = None,
    stage: Annotated[str | None, typer.Option(help="generate | sft | ppo | eval: that command alone.",
                                              show_default="the stages of `spa pipeline`")] = None,
    format_: FormatOpt = "table", as_json: JsonOpt = False,
) -> None:
    """Memory per GPU of every stage, planned before anything runs.

    Weights, gradients, optimizer state, activations, buckets and vLLM's share, per phase; exits 2
    with the settings that would make a stage fit when one does not."""
    from stages import plan as stage_plan
    from stages.evaluation.tables import markdown_table, print_wide

    shape = _output_format(format_, as_json)
    cfg = _load(config, set_, False)
    report = stage_plan.run(cfg, gpus, gpu_memory, stage)
    if shape == "json":
        typer.echo(json.dumps(report.to_json(), indent=2))
    elif shape == "markdown":
        typer.echo(markdown_table(stage_plan.headings(), stage_plan.rows(report)), nl=False)
    else:
        print_wide(stage_plan.describe(report, str(config)), console)
    if not report.fits:
        _fail(report.error)


# ---- looking at runs ----------------------------------------------------------------------------


@app.command()
@user_errors
def probe(
    model: Annotated[str, typer.Argument(help="A model directory or a built-in model's name (sets model.name).")],
    config: ConfigOpt = None, set_: SetOpt = None, quiet: QuietOpt = False, env: EnvOpt = None,
    states: Annotated[int | None, typer.Option(help="Held-out states to probe, every action of each.",
                                               show_default="32")] = None,
    first_seed: Annotated[int | None, typer.Option(help="Seed of the first state (the next ones follow it).",
                                                   show_default="1000: apart from eval and train seeds")] = None,
    render_mode: Annotated[str | None, _render_mode("eval")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Report to write (and its .cases.jsonl).")] = Path(
        "probe.json"),
    format_: FormatOpt = "table", as_json: JsonOpt = False,
) -> None:
    """Score a model's world model per kind of action: its predicted next state against the copy.

    Every action of held-out states, split by what it does (Sokoban: move, wall, push, push_blocked):
    greedy predictions by exact match, cells and copies, and whether the model finds the true next
    state more likely than the unchanged one."""
    from stages import probe as stage
    from stages.evaluation.tables import markdown_table

    shape = _output_format(format_, as_json)
    cfg = _load(config, set_, quiet, model__name=model, env__name=env, eval__render_mode=render_mode)
    given = {"states": states, "first_seed": first_seed}
    report = stage.run(cfg, out, **{key: value for key, value in given.items() if value is not None})
    if shape == "json":
        typer.echo(json.dumps(report, indent=2))
    elif shape == "markdown":
        typer.echo(markdown_table(stage.HEADINGS, stage.table_cells(report)), nl=False)
    else:
        settings = report["settings"]
        _print_table(f"spa probe: {settings['model']} on {settings['env']} ({settings['states']} states)",
                     stage.HEADINGS, stage.table_cells(report))


def _print_table(title: str, headers: Sequence[str], cells: Sequence[Sequence[str]]) -> None:
    from rich.table import Table

    from stages.evaluation.tables import print_wide

    table = Table(*headers, title=title)
    for row in cells:
        table.add_row(*row)
    print_wide(table, console)


@app.command()
@user_errors
def plot(
    runs: Annotated[list[Path], typer.Argument(help="Run directories (sft, ppo or pipeline) or metrics.jsonl "
                                               "files; several are overlaid.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="PNG to write.")] = Path("curves.png"),
    validation: Annotated[bool, typer.Option("--validation", help=(
        "Draw instead the validation Pass@1 of ppo run directories against their step, with 95% bands "
        "(their val/ reports)."), show_default="false")] = False,
) -> None:
    """Draw the training curves of sft, ppo or pipeline runs into a PNG.

    SFT loss, validation loss and learning rate; PPO reward, success, validation Pass@1 and Pass@k,
    KL, entropy, clip fraction, response length and the collapse diagnostics, against the step."""
    from stages.common.errors import UserError
    from stages.evaluation import plots

    plots.check_plot(out, "--out")
    if validation:
        found = plots.read_validations(runs)
        if len(found) < len(runs):
            missing = sorted({str(run) for run in runs} - {label for label, _ in found})
            raise UserError(f"{', '.join(missing)} holds no validation report (val/step-N.json); --validation "
                            "expects ppo run directories validated with ppo.val_every")
        path = plots.save_png(plots.validation_figure(found), out)
    else:
        path = plots.plot_curves(plots.read_runs(runs), out)
    typer.echo(f"{'validation' if validation else 'curves'} of {len(runs)} run(s) in {path}")


@app.command()
@user_errors
def view(
    source: Annotated[Path, typer.Argument(help="A run directory (pipeline, sft, ppo), an eval report.json or "
                                           "a trajectories.jsonl.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="HTML page to write.")] = Path("view.html"),
) -> None:
    """Write one HTML page to browse a run, an eval report or a trajectories file.

    The page is self-contained (no server, nothing fetched): a run's table and plots, and an episode
    browser with each turn's board, the model's observation and prediction beside the true states
    (wrong cells marked), actions, rewards and penalties."""
    from stages.evaluation import viewer

    summary = viewer.write_page(source, out)
    typer.echo(summary)


# ---- helpers ----------------------------------------------------------------------------------


@config_app.command("show")
@user_errors
def config_show(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the resolved configuration as YAML (defaults, --config, then --set)."""
    from stages.common.config import load_config, to_yaml

    typer.echo(to_yaml(load_config(config, set_ or [])), nl=False)


@config_app.command("docs")
@user_errors
def config_docs(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Markdown file to write.",
                                             show_default="none: print the page")] = None,
) -> None:
    """Write the configuration reference (docs/configuration.md) from the schema.

    Every key with its type, default, accepted values, the paper's value and what it is for."""
    from stages.common import artifacts
    from stages.common import config_docs as docs

    page = docs.reference()
    if out is None:
        typer.echo(page, nl=False)
        return
    with artifacts.atomic_write(out) as handle:
        handle.write(page)


@app.command()
@user_errors
def envs(format_: FormatOpt = "table", as_json: JsonOpt = False) -> None:
    """List the games and their settings."""
    from rich.table import Table

    import envs as registry
    from stages.evaluation.tables import markdown_table, print_wide

    shape = _output_format(format_, as_json)
    rows = []
    for name in registry.names():
        spec = registry.spec(name)
        try:
            game = registry.make(name)  # settings such as other action names live on the instance
        except Exception:  # noqa: BLE001 - a game needing an option (qa: path) is described by its class
            game = spec.load_class()
        rows.append({"name": name, "gym_id": spec.gym_id, "settings": dict(spec.kwargs),
                     "actions": _moves(game) or "free-form", "max_actions_per_traj": game.max_actions_per_traj,
                     "prompt_modes": list(registry.prompt_modes(game)),
                     "render_modes": list(registry.render_modes(game)), "summary": spec.summary})
    if shape == "json":
        typer.echo(json.dumps(rows, indent=2))
        return
    headers = ("name", "gymnasium id", "settings", "actions / turn budget", "prompt / render modes", "what")
    cells = [(row["name"], row["gym_id"], ", ".join(f"{k}={v}" for k, v in row["settings"].items()),
              f"{row['actions']} / {row['max_actions_per_traj']}",
              f"{', '.join(row['prompt_modes'])} / {', '.join(row['render_modes'])}", row["summary"]) for row in rows]
    if shape == "markdown":
        typer.echo(markdown_table(headers, cells), nl=False)
        return
    table = Table(*headers)
    for column in table.columns[:2]:
        column.no_wrap = True  # names are typed: never cut
    for row in cells:
        table.add_row(*row)
    print_wide(table, console)


@app.command()
@user_errors
def play(
    config: ConfigOpt = None, set_: SetOpt = None,
    env: EnvOpt = None,
    seed: Annotated[int, typer.Option(help="Puzzle seed.")] = 0,
    render_mode: Annotated[str | None, typer.Option(
        help="coords | text.", show_default="coords where the game has coordinates, else text")] = None,
    actions: Annotated[str | None, typer.Option(help="Play these actions ('Up || Left') and exit.",
                                                show_default="none: play interactively")] = None,
) -> None:
    """Play a game in the terminal.

    Shows the state with coordinates, the reward, done, and why a move changed nothing. The game
    and its options come from the config (qa: --set env.options.path=FILE)."""
    import envs as registry
    from stages.agent.env_manager import make_env
    from stages.common.distributed import require_one_process

    require_one_process("play", "run it without torchrun / deepspeed")
    if seed < 0:
        _fail(f"--seed must be >= 0, got {seed}")
    cfg = _load(config, set_, False, env__name=env)
    if render_mode is None:
        game_class = registry.spec(cfg.env.name).load_class()
        render_mode = "coords" if "coords" in registry.render_modes(game_class) else "text"
    game = make_env(cfg.env, render_mode)
    text, _ = game.reset(seed=seed)
    typer.echo(text)
    names = _moves(game)
    if actions is not None:
        moves = [a.strip() for a in actions.split("||")]
        bad = [m for m in moves if game.parse_action(m) is None]
        if bad:
            _fail(f"not an action in {cfg.env.name}: {bad[0]!r}; actions are {names}")
        for move in moves:
            if _play_one(game, move):
                break
        return
    console.print(f"actions: {names}; several separated by ' || '; q to quit", highlight=False)
    for line in sys.stdin:
        if line.strip().lower() in ("q", "quit", "exit"):
            break
        moves = [a.strip() for a in line.split("||") if a.strip()]
        if not moves or any(game.parse_action(m) is None for m in moves):
            err_console.print(f"not understood: {line.strip()!r}; actions are {names}", highlight=False)
            continue
        if any(_play_one(game, move) for move in moves):
            break


def _moves(game: Any) -> str:
    """How a game's moves are written: its action names, or its free-form move format."""
    return " | ".join(game.action_names) if game.action_names else getattr(game, "move_format", "")


def _play_one(game: Any, move: str) -> bool:
    text, reward, terminated, truncated, info = game.step(move)
    unchanged = f"  (no effect: {info['no_effect']})" if info.get("no_effect") else ""
    typer.echo(f"> {game.parse_action(move)}  reward {reward:+g}{unchanged}")
    typer.echo(text)
    done = terminated or truncated
    if done:
        outcome = "solved" if info["success"] else ("truncated" if truncated else "failed")
        console.print(f"done: {outcome}", highlight=False)
    return done


def main() -> None:  # pragma: no cover - the console script entry point
    app()
