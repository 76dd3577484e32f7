# Every target sets itself up on a fresh machine: a local virtual environment with that torch.
# `make test TORCH=2.8.0` runs the suite on another torch (its own .venv-torch2.8.0; wheels other
# than the default come from the registry).
PYTHON ?= python3
TORCH ?= 2.13.0
ifeq ($(TORCH),2.13.0)
VENV := .venv
else
VENV := .venv-torch$(TORCH)
endif
PY := $(VENV)/bin/python

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH)
	$(PY) -m pip install --quiet -e '.[test,hf,plot]'
	$(PY) -c "import torch; assert torch.__version__.startswith('$(TORCH)'), torch.__version__"
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
	rm -rf .venv .venv-torch* build *.egg-info
