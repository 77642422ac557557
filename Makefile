# remat: `make demo` runs the demo, `make test` the tests (newest transformers), `make compat` the
# tests on each older supported transformers release. Each target sets up its own virtual
# environment first.
#
# torch is installed by exact version first. This project's machines carry the 2.13.0 CPU wheel
# where pip finds it; elsewhere pip's default on Linux is a multi-GB CUDA build: name PyTorch's CPU
# index (`make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`).

PYTHON ?= python3
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_FROM = $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
NEWEST_TRANSFORMERS ?= 5.24.0
OLDER_TRANSFORMERS ?= 4.57.6 5.17.0
PINS = peft==0.21.2 accelerate==1.15.0 trl==1.16.0 safetensors==0.8.0 pytest==9.2.0 pytest-xdist==3.8.0 bitsandbytes==0.50.2 matplotlib==3.11.2 nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0
# Liger Kernel (tests/test_head.py: remat stands down where Liger replaced the forward; Triton imports
# without a GPU). 0.8 needs transformers 5; 0.7.0 is the newest that takes 4.57.
LIGER = triton==3.9.0 liger-kernel==0.8.5
LIGER_4.57.6 = triton==3.9.0 liger-kernel==0.7.0
# DeepSpeed (tests/test_deepspeed.py: ZeRO-2/3 on two gloo ranks, DS_ACCELERATOR=cpu). Its source build imports
# torch, so it is built against the venv's own CPU torch (no build isolation). The newest, and on 5.17.0 the
# 0.19.2 that pins people stay on (0.19.3 changed how ZeRO-3 releases parameters after recompute).
DEEPSPEED = deepspeed==0.19.8
DEEPSPEED_5.17.0 = deepspeed==0.19.2
# DeepSpeed builds its CPU shared-memory collective (a C++ op) the first time a process group starts: about 30 s,
# inside the suite's first DeepSpeed launch on a fresh environment (85 s for that test, against 22 s once built).
# Built here, with the environment, into the extension cache tests/conftest.py points torch at (per environment);
# where it does not build (no C++ compiler) the environment is still made, and the DeepSpeed tests try again.
DEEPSPEED_PREBUILD = import os, sys; os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions")); os.environ["DS_ACCELERATOR"] = "cpu"; from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder("ShareMemCommBuilder").load()
DEEPSPEED_NOT_BUILT = make: DeepSpeed's CPU shared-memory op did not build here (see above); its tests will build it
VENV = .venv

.PHONY: demo demo-notice test compat lint clean

$(VENV)/.installed-$(NEWEST_TRANSFORMERS): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet "$(TORCH)" $(TORCH_FROM)
	$(VENV)/bin/pip install --quiet "transformers==$(NEWEST_TRANSFORMERS)" $(PINS) $(LIGER) ruff
	$(VENV)/bin/pip install --quiet --no-build-isolation $(DEEPSPEED)
	$(VENV)/bin/python -c '$(DEEPSPEED_PREBUILD)' > /dev/null || echo "$(DEEPSPEED_NOT_BUILT)"
	$(VENV)/bin/pip install --quiet --no-deps -e .
	rm -f $(VENV)/.installed-* && touch $@

# The notice comes first (prerequisites run in order), before the environment is set up.
demo: demo-notice $(VENV)/.installed-$(NEWEST_TRANSFORMERS)
	$(VENV)/bin/python -m remat.demo

demo-notice:
	@echo "make demo: about 1-2 minutes of CPU training on an idle machine (longer on a busy one);"
	@echo "the first run also sets up $(VENV) (torch, transformers, peft: several minutes, once)."

# Two pytest workers (pytest-xdist), one per core of the 2-core machines the suite is sized for: each
# test runs one intra-op thread (tests/conftest.py), so two workers keep both cores busy. A plain
# `pytest` still runs the suite in one process. `--dist loadscope` sends a module's tests to one worker, so a
# module-scoped fixture that launches processes (DDP, FSDP2, DeepSpeed) runs once, not once per worker
# (`--dist loadgroup` would group by mark, but its marks are not applied under pytest 9.2 with xdist 3.8).
PYTEST = python -m pytest -n 2 --dist loadscope

test: $(VENV)/.installed-$(NEWEST_TRANSFORMERS)
	$(VENV)/bin/$(PYTEST)

.venvs/tf-%/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv .venvs/tf-$*
	.venvs/tf-$*/bin/pip install --quiet --upgrade pip
	.venvs/tf-$*/bin/pip install --quiet "$(TORCH)" $(TORCH_FROM)
	.venvs/tf-$*/bin/pip install --quiet "transformers==$*" $(PINS) $(or $(LIGER_$*),$(LIGER))
	.venvs/tf-$*/bin/pip install --quiet --no-build-isolation $(or $(DEEPSPEED_$*),$(DEEPSPEED))
	.venvs/tf-$*/bin/python -c '$(DEEPSPEED_PREBUILD)' > /dev/null || echo "$(DEEPSPEED_NOT_BUILT)"
	.venvs/tf-$*/bin/pip install --quiet --no-deps -e .
	touch $@

# The whole suite once per older transformers release, each in its own environment
# (`make test` runs it on the newest, in $(VENV); CI runs both).
compat: $(foreach v,$(OLDER_TRANSFORMERS),.venvs/tf-$(v)/.installed)
	@set -e; for env in $(foreach v,$(OLDER_TRANSFORMERS),.venvs/tf-$(v)); do \
		echo "== $$env: transformers $$($$env/bin/python -c 'import transformers; print(transformers.__version__)')"; \
		$$env/bin/$(PYTEST); \
	done

lint: $(VENV)/.installed-$(NEWEST_TRANSFORMERS)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) .venvs build *.egg-info src/*.egg-info
