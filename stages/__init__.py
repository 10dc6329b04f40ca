"""The stages of the SPA recipe, each a plain `run(config)` that reads and writes artifacts on disk.

Entry modules, one per stage (what `spa <stage>` calls):

    generate   env + policy         -> trajectories.jsonl     self-play rollouts
    clean      trajectories.jsonl   -> sft.jsonl (+ .val)     ground-truth states, filters
    sft        sft.jsonl + model    -> checkpoint directory   world-model fine-tuning
    ppo        checkpoint + env     -> checkpoint directory   multi-turn PPO with a critic
    evaluate   checkpoint + env     -> report.json            Pass@k, world-model accuracy
    pipeline   config               -> run directory          the paper's arms, resumable
    plan       config               -> a table                memory per GPU of each stage, before it runs

Below them, what the stages share, by what it is (imports flow down this list, never up;
`tests/test_layout.py` checks it):

    common/      config (schema and ranges), artifacts (atomic files and directories, JSONL,
                 manifests), runs (the "same run?" rule), console (messages and progress),
                 tracking (TensorBoard and wandb beside metrics.jsonl), models (finding,
                 converting, loading and sizing models), spa_data (SPA's released parquet SFT data),
                 seeds, errors
    agent/       the agent loop: prompts, parsing, episode records, the env manager, the context
                 manager, the agent proxy (`play`), states (comparing states; VAGEN's state
                 reward), and the generation backends (hf, vllm, random)
    training/    the engines (DeepSpeed ZeRO or plain torch), one trainable-model setup for SFT and
                 PPO, the memory each stage needs on a GPU, the run directory and its checkpoints,
                 SFT data and masks, PPO samples, networks and algorithms
    evaluation/  metrics (Pass@k, world-model accuracy), state perplexity, the eval runner,
                 reports, tables, plots (training curves, Pass@k bands) and the viewer (`spa
                 view`'s HTML page)
"""

import os

# oneDNN (spa's CPU linear layers, `common/kernels/linear.py`; PyTorch's bf16 matmuls) keeps up to 1024
# compiled products by shape, each holding its own scratch memory; training meets a new shape with
# every micro-batch length, so the default cache holds hundreds of megabytes nobody reuses. A few
# dozen cover a decode step's shapes. Read by oneDNN at its first product, so set at import.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")
