# p2pcomm: `make test` runs every test that needs no GPU; `make gpu-test` the
# GPU ones (on a machine with GPUs); `make demo` shows it working.
SHELL := /bin/bash
GO ?= go
# The Python environment: .venv in the checkout, made on first use with the
# pinned packages of requirements-dev.txt (and remade when that file changes).
# PYTHON=/path/to/python uses an existing environment instead, as it is.
VENV := $(CURDIR)/.venv
ifeq ($(origin PYTHON),undefined)
PYTHON := $(VENV)/bin/python
PY_ENV := $(VENV)/.installed
export PATH := $(VENV)/bin:$(PATH)
endif
TORCHRUN ?= $(PYTHON) -m torch.distributed.run
LIB := build/libp2pcomm.so
GO_SOURCES := $(shell find golib native -name '*.go' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.c') go.mod go.sum
NPROC_GPU ?= $(shell nvidia-smi -L 2>/dev/null | wc -l)
export PYTHONPATH := $(CURDIR)/python$(if $(PYTHONPATH),:$(PYTHONPATH))
export P2PCOMM_LIB ?= $(CURDIR)/$(LIB)
# Tests use the UCX that requirements-dev.txt installs, not whatever the system has
# (looked up when a recipe runs: the environment may be made after this file is read,
# and $(wildcard) would keep its first, empty answer).
export P2PCOMM_UCX_LIB ?= $(shell ls $(VENV)/lib/python3*/site-packages/libucx/lib/libucp.so.0 2>/dev/null | head -n 1)
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1
# Never let NCCL, torch or NVSHMEM use NVLink multicast on shared machines.
export NCCL_NVLS_ENABLE := 0
export TORCH_SYMM_MEM_DISABLE_MULTICAST := 1
export NVSHMEM_DISABLE_NVLS := 1

.PHONY: setup lib test test-go test-go-race test-go-and-python test-mpi test-python test-dist gpu-test gpu-test-shared demo bench fuzz vet clean

setup: $(PY_ENV) build/gomod

$(VENV)/.installed: requirements-dev.txt
	@command -v python3 >/dev/null || { echo "python3 (>= 3.9) is needed to make $(VENV)"; exit 1; }
	@echo "setting up $(VENV): $$(grep -v '^#' requirements-dev.txt | tr '\n' ' ')"
	test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --disable-pip-version-check --progress-bar off -q -r requirements-dev.txt
	touch $@

build/gomod: go.mod go.sum
	@mkdir -p build
	$(GO) mod download
	touch $@

lib: $(LIB)

# One library for every machine: CUDA, NVRTC, Open MPI and UCX are opened at run time.
$(LIB): $(GO_SOURCES) build/gomod
	$(GO) build -buildmode=c-shared -trimpath -o $@ ./golib/capi

vet:
	$(GO) vet ./...
	@test -z "$$(gofmt -l golib native tests/go)" || { gofmt -l golib native tests/go; echo "gofmt needed"; exit 1; }

# native/kernels' NVRTC builds of every kernel (minutes on 2 cores when the
# kernel cache is cold; C++ that the race detector does not see) run beside
# the other tests, each build reported as it ends.
KERNEL_TEST_LOG := build/logs/kernels.log
KERNEL_TEST = $(GO) test -count=1 -timeout 30m -v ./native/kernels > $(KERNEL_TEST_LOG) 2>&1
# FOLLOW log,pid,filter,what: prints log (through filter) as it grows until
# process pid ends, and a line saying so whenever it has been quiet for
# QUIET_S seconds (Go prints a package, or a kernel build, only when it ends).
QUIET_S := 25
FOLLOW = { tail -n +1 -f $(1) --pid=$(2) | $(3); } & tailer=$$!; \
	last=$$(date +%s); while kill -0 $(2) 2>/dev/null; do sleep 1; \
		mod=$$(stat -c %Y $(1)); test $$mod -gt $$last && last=$$mod; \
		test $$(( $$(date +%s) - last )) -ge $(QUIET_S) || continue; \
		echo "  ... $(4) still running, nothing new for $(QUIET_S) s"; last=$$(date +%s); \
	done; wait $$tailer
KERNEL_REPORT = $(call FOLLOW,$(KERNEL_TEST_LOG),$$kernels,grep --line-buffered -vE '^(=== (RUN|PAUSE|CONT|NAME)|\s*--- PASS|PASS$$)',the kernel builds are)
# BESIDE_KERNELS cmd: runs cmd while the kernel builds run, then their report.
BESIDE_KERNELS = @mkdir -p build/logs; set -o pipefail; \
	$(KERNEL_TEST) & kernels=$$!; \
	echo "kernel builds run beside the other tests: $(KERNEL_TEST_LOG)"; \
	$(1); rest=$$?; \
	$(KERNEL_REPORT); wait $$kernels; kern=$$?; \
	test $$rest -eq 0 && test $$kern -eq 0 || { echo "failed: tests $$rest, kernel builds $$kern ($(KERNEL_TEST_LOG))"; exit 1; }

test-go-race:
	$(GO) test -race -count=1 -timeout 30m $$($(GO) list ./... | grep -v '/native/kernels$$')

test-go: $(PY_ENV)
	$(call BESIDE_KERNELS,$(MAKE) --no-print-directory test-go-race)

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzDecode -fuzztime 300000x ./golib/bootstrap

test-mpi:
	@command -v mpirun >/dev/null || { echo "SKIP test-mpi: the MPI tests need Open MPI (apt-get install openmpi-bin)"; exit 0; }; \
	set -e; \
	$(GO) test -c -o build/mpi.test ./tests/go/mpi; \
	$(GO) test -c -o build/bootstrap.test ./golib/bootstrap; \
	mpirun --allow-run-as-root --oversubscribe -np 2 build/mpi.test -test.v -test.count=1; \
	mpirun --allow-run-as-root --oversubscribe -np 2 build/bootstrap.test -test.run MPI -test.v -test.count=1

test-python: lib $(PY_ENV)
	$(PYTHON) -m pytest -q tests/python --ignore=tests/python/dist

# RANKS n ARGS: python ARGS as the n ranks of a local job; rank 0's output as it
# comes, another rank's when it fails, every rank's in build/logs/<target>-n<n>/.
RANKS = $(PYTHON) tests/run_ranks.py --log-dir build/logs/$@-n$(1) -n $(1) --

test-dist: lib $(PY_ENV)
	$(call RANKS,2) -m pytest -q -x tests/python/dist
	$(call RANKS,4) -m pytest -q -x tests/python/dist
	$(call RANKS,3) -m pytest -q -x tests/python/dist/test_moe.py tests/python/dist/test_moe_nodes.py
	$(call RANKS,8) -m pytest -q -x tests/python/dist/test_moe.py

# Two streams side by side, so that both cores stay busy: the distributed
# suites, whose ranks spend much of their time waiting on each other, print as
# they go; the python tests that need no ranks and the Go tests (race
# detector, fuzzing, MPI) go to build/logs/side.log, which follows.
SIDE_LOG := build/logs/side.log
test-go-and-python: lib $(PY_ENV)
	@mkdir -p build/logs; : > $(SIDE_LOG); \
	$(MAKE) --no-print-directory test-python test-go-race fuzz test-mpi > $(SIDE_LOG) 2>&1 & side=$$!; \
	echo "the python tests that need no ranks and the Go tests run beside these: $(SIDE_LOG)"; \
	$(MAKE) --no-print-directory test-dist; distrc=$$?; \
	echo "---- $(SIDE_LOG) ----"; \
	$(call FOLLOW,$(SIDE_LOG),$$side,cat,the Go tests are); wait $$side; siderc=$$?; \
	test $$distrc -eq 0 && test $$siderc -eq 0 || { echo "failed: distributed suites $$distrc, the others $$siderc"; exit 1; }

test: lib $(PY_ENV)
	$(call BESIDE_KERNELS,$(MAKE) --no-print-directory vet test-go-and-python)

gpu-test: lib $(PY_ENV)
	@test "$(NPROC_GPU)" -ge 2 || { echo "gpu-test needs at least 2 GPUs (found $(NPROC_GPU))"; exit 1; }
	P2PCOMM_TEST_GPU=1 $(call RANKS,$(NPROC_GPU)) -m pytest -q -x tests/python/dist
	P2PCOMM_TEST_GPU=1 $(call RANKS,2) -m pytest -q -x tests/python/dist

# World sizes beyond the GPUs at hand: NPROC ranks share the GPUs under MPS
# (correctness only; see tools/gpu_shared.sh).
NPROC ?= 8
gpu-test-shared: lib $(PY_ENV)
	tools/gpu_shared.sh 3600 $(NPROC) tests/python/dist -k "not cpu"

demo: lib $(PY_ENV)
	$(TORCHRUN) --nproc_per_node=$(if $(filter-out 0 1,$(NPROC_GPU)),$(NPROC_GPU),2) -m p2pcomm.demo

bench: lib $(PY_ENV)
	$(TORCHRUN) --nproc_per_node=$(if $(filter-out 0 1,$(NPROC_GPU)),$(NPROC_GPU),2) -m p2pcomm.bench

clean:
	rm -rf build dist
