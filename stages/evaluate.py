"""`spa eval`: play fixed eval puzzles n times each and report Pass@k, episode figures,
world-model accuracy and (optionally) state perplexity.

    model + env  ->  report.json, report.trajectories.jsonl, report.json.manifest.json

The model is opened through `stages.agent.backends.make_backend` (``rollout.backend``); the eval
itself is `stages.evaluation.runner` (the protocol is in its docstring), the report's layout and
comparison `stages.evaluation.reports`, its tables `stages.evaluation.tables` and its plots
`stages.evaluation.plots`.
"""

from __future__ import annotations

from typing import Any

from stages.agent.backends import make_backend
from stages.common.config import SPAConfig
from stages.evaluation.runner import check, evaluate


def run(config: SPAConfig, backend: Any = None) -> dict:
    """Run the eval that ``config`` describes; write and return the report. `backend` (a
    notebook's or a test's) replaces the one `rollout.backend` would open."""
    if backend is not None:
        return evaluate(config, backend)
    check(config, config.rollout.backend)  # bad settings and paths are refused before a model loads
    backend = make_backend(config.model, config.rollout, prompt_mode=config.eval.prompt_mode)
    report = evaluate(config, backend)
    backend.close()  # a vLLM engine's memory goes back before the next pipeline stage
    return report
