"""Does SPA's gain come from the world model or from the format? The format control on Sokoban.

The arms of `sokoban.yaml` that name an `sft_data` file train on the SFT rows of the built-in arm
they are `like` (SPA's self-play rows), with every <observation> and <prediction> content of the
assistant turns replaced by "[MASKED]" (the tags kept) and trained like any other text: the model
learns to write the world-model format with no state in it. The paper's masked control gives
"[MASKED]" no loss (`sft.state_text: masked`); this one trains it, so the format is learnt and the
states are not. The run:

1. `spa pipeline` on the config's other arms (the reproduction's: stages already complete are
   skipped);
2. the masked rows (and their validation split) written from those arms' SFT rows, where `sft_data`
   says;
3. `spa pipeline` on every arm: the control arms' SFT, PPO and evals.

    python experiments/format_control/format_control.py            # from the repository root
    python experiments/format_control/format_control.py --config OTHER.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from stages import pipeline
from stages.common import artifacts
from stages.common.config import SPAConfig, load_config, with_overrides
from stages.common.errors import UserError
from stages.training.sft_data import mask_states


def placeholder_rows(rows: list[dict]) -> list[dict]:
    """The SFT rows with every observation and prediction content of their assistant turns
    replaced by "[MASKED]", everything else as it was."""
    return [{**row, "messages": mask_states(row["messages"])} for row in rows]


def write_placeholder_data(source: Path, target: Path) -> None:
    """`target` (and its validation split) from the rows of `source` (and of its split)."""
    files = {}
    for read, write in ((source, target), (artifacts.val_path(source), artifacts.val_path(target))):
        rows = artifacts.read_jsonl(read, required=("messages",))[0] if read.is_file() else []
        files[write] = placeholder_rows(rows)
    artifacts.write_jsonl_files(files)


def split(config: SPAConfig) -> tuple[SPAConfig, dict[Path, str]]:
    """The config without the control arms, and each control file with the clean stage whose rows
    it masks (the `like` arm's: `clean/<id>`)."""
    controls = [arm for arm in config.pipeline.arms if isinstance(arm, dict) and arm.get("sft_data")]
    if not controls:
        raise UserError("no arm of the config names an sft_data file: nothing to control")
    sources = {}
    for arm in controls:
        like = pipeline.BUILT_IN.get(arm.get("like", ""))
        if like is None or "clean" not in like.ids:
            raise UserError(f"arm {arm['name']}: `like` must name a built-in arm with self-play SFT data, e.g. spa")
        sources[Path(arm["sft_data"])] = f"clean/{like.ids['clean']}"
    others = [arm for arm in config.pipeline.arms if arm not in controls]
    return with_overrides(config, {"pipeline.arms": others}), sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=HERE / "sokoban.yaml")
    args = parser.parse_args()
    config = load_config(args.config)
    reproduction, sources = split(config)
    pipeline.run(reproduction)
    stages = {stage.name: stage for stage in pipeline.plan(reproduction).stages}
    for target, stage in sources.items():
        if stage not in stages:
            raise UserError(f"{target}: the config's other arms have no stage {stage} whose rows it would mask")
        write_placeholder_data(Path(stages[stage].output()), target)
    pipeline.run(config)


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
