"""`spa eval`: play fixed eval puzzles n times each and report Pass@k, episode figures,
world-model accuracy and (optionally) state perplexity.

    model + env  ->  report.json, report.trajectories.jsonl, report.json.manifest.json

The model is opened through `stages.agent.backends.make_backend` (``rollout.backend``); the eval
itself is `stages.evaluation.runner` (the protocol is in its docstring), the report's layout and
comparison `stages.evaluation.reports`, its tables `stages.evaluation.tables` and its plots
`stages.evaluation.plots`.

Under a launcher (`torchrun --nproc_per_node N -m spa_cli eval ...`) each rank opens its own
backend on its own device and plays its share of the seeds; rank 0 writes the one report and
trajectory file, equal to a one-process eval's (`stages.evaluation.runner`).
"""

from __future__ import annotations

from typing import Any

from stages.agent.backends import backend_device, describe_player, make_backend
from stages.common import distributed
from stages.common.config import SPAConfig, to_dict
from stages.common.console import Console
from stages.evaluation.runner import check, evaluate, header


def run(config: SPAConfig, backend: Any = None) -> dict:
    """Run the eval that ``config`` describes; write and return the report. `backend` (a
    notebook's or a test's) replaces the one `rollout.backend` would open."""
    opened = backend is None
    # bad settings and paths are refused before a model loads
    _, _, resuming = check(config, config.rollout.backend if opened else backend.name)
    dist = distributed.start(backend_device(config.model, config.rollout) if opened else "cpu", to_dict(config))
    player = describe_player(config.model, config.rollout, dist.world, backend)
    Console(config.quiet or not dist.main).say(header(config, resuming, player))
    if opened:
        backend = make_backend(config.model, config.rollout, prompt_mode=config.eval.prompt_mode)
    report = evaluate(config, backend, dist=dist)
    if opened:
        backend.close()  # a vLLM engine's memory goes back before the next pipeline stage
    return report
