# Two set-up commands: `make run` (the main job) and `make test` (the default suite).
# On CPU machines torch==2.13.0 (the local CPU wheel) is installed first so no CUDA build is ever pulled.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-slow gpu-test venv clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# The main job: a real GRPO run on the embedded default (tiny model, built-in task; ARGS may add overrides).
run: $(STAMP)
	$(VPY) -m shardrl.trainer.main_ppo $(ARGS)

test: $(STAMP)
	$(VPY) -m pytest -q -x --durations=15 $(ARGS)

test-slow: $(STAMP)
	$(VPY) -m pytest -q -m slow $(ARGS)

# On the GPU machine (offline; system python3 with CUDA torch, no venv): the wheels that ../shared/tools/gpu-wheels
# built into .whl/ go to /tmp/site, then the GPU-marked tests run (-rP prints the measured mismatches and errors).
GPU_ENV := PYTHONPATH=/tmp/site:$(CURDIR) NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
	NVSHMEM_DISABLE_NVLS=1 RAY_AUTH_MODE=disabled
gpu-test:
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
	$(GPU_ENV) python3 -m pytest -q -rP -m gpu $(ARGS)

clean:
	rm -rf $(VENV)
