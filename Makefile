# Two entry points for a fresh machine: `make train` and `make test`. Each first sets up the project-local
# virtual environment .venv/ from the lock (requirements/lock-cpu.txt), once, and again only when
# pyproject.toml or the lock changes. Nothing is installed into the system Python.
PYTHON ?= python3
VENV ?= .venv
LOCK ?= requirements/lock-cpu.txt
EXTRAS ?= dev
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?=   # e.g. --index-url https://download.pytorch.org/whl/cpu where the registry has only CUDA builds
PY := $(VENV)/bin/python
comma := ,
# One stamp per set of extras: `make setup EXTRAS=dev,logging` on an existing .venv/ installs the new ones
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup train test lock

setup: $(STAMP)

# Each step says what it installs, and pip lists what it downloads: a first setup takes minutes, never silent.
$(PY):
	@echo "setup: creating the virtual environment $(VENV)/"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

# Without a GPU, the CPU build of torch goes in first, so no CUDA packages are pulled in.
$(STAMP): pyproject.toml $(LOCK) | $(PY)
	@command -v nvidia-smi >/dev/null 2>&1 || { echo "setup: installing torch $(TORCH_VERSION), CPU build (no GPU here)"; \
		$(PY) -m pip install "torch==$(TORCH_VERSION)" $(TORCH_CPU_INDEX); }
	@echo "setup: installing rlsys with extras [$(EXTRAS)] at the versions of $(LOCK) (Ray, DeepSpeed, transformers, ...)"
	$(PY) -m pip install -c $(LOCK) -e ".[$(EXTRAS)]"
	@echo "setup: done; the command is $(VENV)/bin/rlsys"
	touch $@

train: setup
	$(VENV)/bin/rlsys train configs/tiny.yaml

test: setup
	$(PY) -m pytest tests -q --durations=30

# Refresh the lock: resolve the newest versions the ranges in pyproject.toml admit, in a scratch
# environment, and write them to $(LOCK). Run `make test` afterwards before committing it.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q "torch==$(TORCH_VERSION)" $(TORCH_CPU_INDEX)
	.venv-lock/bin/python -m pip install -q -e ".[dev,real,bench]"
	.venv-lock/bin/python requirements/write_lock.py .venv-lock/bin/python $(LOCK)
	rm -rf .venv-lock
