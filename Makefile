# Every target sets itself up on a fresh machine: a local .venv with the CPU build of torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test,hf,plot]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/train_omni.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(VENV)/.installed
	$(PY) benchmarks/planner.py
	$(PY) benchmarks/e2e.py

clean:
	rm -rf $(VENV) build *.egg-info
