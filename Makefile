# Every target sets itself up on a fresh machine: a local virtual environment with that torch.
# `make test TORCH=2.8.0` runs the suite on another torch (its own .venv-torch2.8.0; wheels other
# than the default come from the registry); `PYTEST_ARGS=...` passes options to pytest.
PYTHON ?= python3
TORCH ?= 2.13.0
# The transformers the suite is pinned to (tests/test_hf_families.py walks its VLM families);
# raising it is a deliberate change that test then checks. `make test-hf TRANSFORMERS=5.24.0`
# checks the families of another release (in a venv of its own).
TRANSFORMERS_PIN := 5.25.0
TRANSFORMERS ?= $(TRANSFORMERS_PIN)
ifneq ($(TRANSFORMERS),$(TRANSFORMERS_PIN))
VENV := .venv-torch$(TORCH)-transformers$(TRANSFORMERS)
else ifeq ($(TORCH),2.13.0)
VENV := .venv
else
VENV := .venv-torch$(TORCH)
endif
PY := $(VENV)/bin/python
# Some machines cap pip's torch below the newest release (a constraint in pip's config file):
# the venv of a torch newer than CAPPED_TORCH installs with pip reading no config file at all.
CAPPED_TORCH := 2.14.1
ABOVE_CAP := $(shell printf '%s\n' $(CAPPED_TORCH) $(TORCH) | sort -V | tail -n 1 | grep -vxF $(CAPPED_TORCH))
PIP := $(if $(ABOVE_CAP),PIP_CONFIG_FILE=/dev/null) $(PY) -m pip

.PHONY: setup demo test test-hf lint bench clean

$(VENV)/.installed-$(TRANSFORMERS): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH)
	$(PIP) install --quiet -e '.[test,hf,plot]' transformers==$(TRANSFORMERS)
	$(PY) -c "import torch; assert torch.__version__.startswith('$(TORCH)'), torch.__version__"
	touch $@

setup: $(VENV)/.installed-$(TRANSFORMERS)

demo: $(VENV)/.installed-$(TRANSFORMERS)
	$(PY) examples/train_omni.py

test: $(VENV)/.installed-$(TRANSFORMERS)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-hf: $(VENV)/.installed-$(TRANSFORMERS)
	$(PY) -m pytest -q tests/test_hf_families.py $(PYTEST_ARGS)

lint: $(VENV)/.installed-$(TRANSFORMERS)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(VENV)/.installed-$(TRANSFORMERS)
	$(PY) benchmarks/planner.py
	$(PY) benchmarks/e2e.py

clean:
	rm -rf .venv .venv-torch* build *.egg-info
