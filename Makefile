# Two entry points for a fresh machine: `make train` and `make test` (each sets up first).
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?=   # e.g. --index-url https://download.pytorch.org/whl/cpu where the registry has only CUDA builds

.PHONY: setup train test bench

# Without a GPU, install the CPU build of torch first so no CUDA packages are pulled in.
setup:
	@command -v nvidia-smi >/dev/null 2>&1 || $(PYTHON) -m pip install -q "torch==$(TORCH_VERSION)" $(TORCH_CPU_INDEX)
	$(PYTHON) -m pip install -q -e ".[dev]"

train: setup
	rlsys train configs/tiny.yaml

test: setup
	$(PYTHON) -m pytest tests -q
