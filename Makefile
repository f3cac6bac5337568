# Two commands do everything on a fresh machine:
#   make demo   - the whole system on this machine (embedded defaults), with a live view
#   make test   - lint, type-check and the full test suite
# and one for the inner loop:
#   make test-fast - unit, planner, server and manifest tests (no SeaweedFS, no process farms)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch's CPU build, for the torch backend's test: it lies on this kind of machine's disk
# (PyPI has no "+cpu" release, so elsewhere this fails fast and that test is skipped,
# which CI=true turns into a failure).
TORCH_CPU ?= torch==2.13.0+cpu
FAST_TESTS := -m "not s3 and not slow"
# Real TensorRT runtime bindings (the lean runtime imports without a GPU) and cuda-python
# builds, each in its own directory: the TensorRT backend's API contract test imports
# each one in a subprocess and checks every call the backend makes against it. Entries are
# bindings:cuda:libs; 10.8's libs wheel on PyPI is a stub that downloads from NVIDIA, so
# its bindings (whose API surface is what the test checks) load 10.16's libraries.
COMPAT := $(VENV)/compat
TRT_COMPAT := 10.8.0.43:cu12:10.16.1.11 10.16.1.11:cu12:10.16.1.11 11.4.0.106:cu13:11.4.0.106
CUDA_COMPAT := 12.9.10 13.5.0

.PHONY: install demo test test-fast lint bench grpc-protocol clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet '$(TORCH_CPU)' \
	  || echo "$(TORCH_CPU) not available here: the torch backend's test will be skipped"
	# the test tooling (e2e/: harness, demo, model builder) is not in the wheel; put it on
	# this venv's path for the tests, benchmarks and the demo
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	  | xargs -I{} sh -c 'echo "$(CURDIR)/e2e" > {}/model_rollout_e2e_tooling.pth'
	for spec in $(TRT_COMPAT); do v=$${spec%%:*}; rest=$${spec#*:}; cu=$${rest%%:*}; libs=$${rest#*:}; \
	  $(BIN)/python -m pip install --quiet --no-deps --target $(COMPAT)/tensorrt-$$v \
	    tensorrt-lean-$$cu-bindings==$$v tensorrt-lean-$$cu-libs==$$libs || exit 1; done
	for v in $(CUDA_COMPAT); do \
	  $(BIN)/python -m pip install --quiet --no-deps --target $(COMPAT)/cuda-bindings-$$v \
	    cuda-bindings==$$v cuda-pathfinder || exit 1; done
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/python -m model_rollout_e2e.demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# -ra prints every skip with its reason; under CI=true only GPU/TensorRT tests may skip
test: lint
	$(BIN)/python -m pytest -q -ra

test-fast: install
	$(BIN)/python -m pytest -q -ra $(FAST_TESTS)

bench: install
	$(BIN)/python bench/swap_under_load.py
	$(BIN)/python bench/cold_start.py
	$(BIN)/python bench/rollout_scale.py

# the KServe v2 gRPC code from the vendored protos (committed; a test checks it is current)
grpc-protocol: install
	$(BIN)/python -m model_server.grpc_protocol.generate

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
