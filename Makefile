# Two commands do everything on a fresh machine:
#   make demo   - the whole system on this machine (embedded defaults), with a live view
#   make test   - lint, type-check and the full test suite
# and one for the inner loop:
#   make test-fast - unit, planner, server and manifest tests (no SeaweedFS, no process farms,
#                    no real control plane)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is not installed: PyPI's build is CUDA's (several GB) and no CPU build is served
# here, so the torch backend's tests are in the GPU tier (marker gpu) and run on a GPU host.
FAST_TESTS := -m "not s3 and not slow and not controlplane"
# Real TensorRT runtime bindings (the lean runtime imports without a GPU) and cuda-python
# builds, each in its own directory: the TensorRT backend's API contract test imports
# each one in a subprocess and checks every call the backend makes against it. Entries are
# bindings:cuda:libs; 10.8's libs wheel on PyPI is a stub that downloads from NVIDIA, so
# its bindings (whose API surface is what the test checks) load 10.16's libraries.
COMPAT := $(VENV)/compat
TRT_COMPAT := 10.8.0.43:cu12:10.16.1.11 10.16.1.11:cu12:10.16.1.11 11.4.0.106:cu13:11.4.0.106
CUDA_COMPAT := 12.9.10 13.5.0
# A real Kubernetes control plane for the tests (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler), built from the Go modules pinned in e2e/controlplane/go.mod and go.sum;
# rebuilt only when those change. GOFLAGS=-p=2: the Go build's memory stays bounded on small CI
# machines. The version stamp makes the API server report v1.37.2 rather than v0.0.0.
CONTROLPLANE := $(VENV)/controlplane
CONTROLPLANE_MOD := e2e/controlplane
CONTROLPLANE_CMDS := etcd kube-apiserver kube-controller-manager kube-scheduler
K8S_VERSION := v1.37.2
K8S_VERSION_LDFLAGS := $(foreach kv,gitVersion=$(K8S_VERSION) gitMajor=1 gitMinor=37 gitTreeState=clean,\
  -X k8s.io/component-base/version.$(kv))

.PHONY: install controlplane prometheus demo test test-fast lint bench grpc-protocol locks images clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
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

$(CONTROLPLANE)/.built: $(CONTROLPLANE_MOD)/go.mod $(CONTROLPLANE_MOD)/go.sum $(wildcard $(CONTROLPLANE_MOD)/cmd/*/main.go)
	@command -v go >/dev/null 2>&1 || { echo "make: Go (1.26 or newer) is needed to build the tests' Kubernetes control plane from $(CONTROLPLANE_MOD)/go.mod"; exit 1; }
	@echo "Building the tests' Kubernetes control plane ($(CONTROLPLANE_CMDS), $(K8S_VERSION)) from Go modules into $(CONTROLPLANE)/bin: the first build downloads and compiles Kubernetes and takes many minutes; later installs reuse it until $(CONTROLPLANE_MOD)/go.mod or go.sum changes"
	mkdir -p $(CONTROLPLANE)/bin
	cd $(CONTROLPLANE_MOD) && GOFLAGS="-p=2 -mod=readonly" CGO_ENABLED=0 go build -trimpath \
	  -ldflags="-s -w $(K8S_VERSION_LDFLAGS)" -o $(CURDIR)/$(CONTROLPLANE)/bin/ $(addprefix ./cmd/,$(CONTROLPLANE_CMDS))
	touch $@

controlplane: $(CONTROLPLANE)/.built

# the canary analysis' PromQL is tested against a real Prometheus: Debian's package (the
# tests start their own on loopback, so the package's service is not needed); as root it
# is installed here, otherwise this says how, and those tests skip (fail under CI=true)
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "Installing Prometheus (Debian's package) for the canary analysis tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
	  else \
	    echo "make: Prometheus is not installed and this is not root: the canary analysis tests will skip; install it with: sudo apt-get install prometheus"; \
	  fi; }

install: $(BIN)/.installed $(CONTROLPLANE)/.built prometheus

# on its own control plane; after the scripted rollouts the cluster stays up 300 s (Ctrl-C
# ends it) for kubectl in another terminal: `make demo DEMO_ARGS="--hold 0"` ends at once
DEMO_ARGS ?=
demo: install
	$(BIN)/python -m model_rollout_e2e.demo $(DEMO_ARGS)

lint: install
	$(BIN)/lint-imports --no-cache
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
	$(BIN)/python bench/planner_scale.py
	$(BIN)/python bench/rollout_scale.py

# the KServe v2 gRPC code from the vendored protos (committed; a test checks it is current)
grpc-protocol: install
	$(BIN)/python -m model_server.frontends.grpc.protocol.generate

# The images' Python dependencies, locked with hashes (uv, a dev dependency) for the
# images' Python (3.12: python:3.12-slim, and NVIDIA's TensorRT image on Ubuntu 24.04) on
# Linux; the Dockerfiles install them with --require-hashes. Run after changing an extra
# in pyproject.toml (tests/deploy/test_images.py fails while a lock does not satisfy it) and to
# take upstream fixes: `make locks UPGRADE=--upgrade`.
LOCK_PYTHON := 3.12
UPGRADE ?=
UV_LOCK = $(BIN)/uv pip compile --quiet --generate-hashes --python-version $(LOCK_PYTHON) \
  --python-platform x86_64-manylinux_2_28 $(UPGRADE)
locks: $(BIN)/.installed
	$(UV_LOCK) requirements/build.in -o requirements/build.txt
	$(UV_LOCK) pyproject.toml --extra server --extra sidecar -o requirements/server-cpu.txt
	$(UV_LOCK) pyproject.toml requirements/server-gpu.in --extra server --extra sidecar \
	  -o requirements/server-gpu.txt
	$(UV_LOCK) pyproject.toml --extra sidecar -o requirements/sidecar.txt
	$(UV_LOCK) pyproject.toml --extra operator -o requirements/operator.txt

# The four images, tagged <name>:<version> (pyproject.toml's, the chart's appVersion):
# bases pinned by digest (tools/check_images.py refuses a FROM by tag alone; it says how
# to refresh a digest), dependencies from requirements/*.txt with --require-hashes.
# Without a Docker engine this says so and exits 2.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGES := server-cpu:Dockerfile.server-cpu server:Dockerfile.server sidecar:Dockerfile.sidecar \
  operator:Dockerfile.operator
images:
	$(PYTHON) tools/check_images.py
	@docker info >/dev/null 2>&1 || { echo "make images: no Docker engine here (docker info failed): nothing built (the Dockerfiles were checked); build where one runs"; exit 2; }
	for spec in $(IMAGES); do name=$${spec%%:*}; file=$${spec#*:}; \
	  docker build -f $$file -t model-rollout-$$name:$(VERSION) . || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
