# expcache build. The host library (g++ only) is always built; the CUDA
# library when nvcc is found. `make help` lists the targets.

PYTHON    ?= python3
CXX       ?= g++
NVCC      ?= $(shell command -v nvcc 2>/dev/null)
BUILD     ?= build
CUDA_ARCHS ?= 80 90
CXXFLAGS  ?= -O2 -g
# make test and test-long: the compiler jobs of their build and their pytest-xdist workers.
JOBS      ?= $(shell nproc 2>/dev/null || echo 2)
WARN       = -Wall -Wextra -Wno-unused-parameter
COMMON     = -std=c++17 -fPIC -fvisibility=hidden -Ilibexpcache/include -Ilibexpcache/src

CORE_SRC  = libexpcache/src/abi_handles.cpp libexpcache/src/abi_setup.cpp libexpcache/src/abi_serve.cpp \
            libexpcache/src/abi_inspect.cpp libexpcache/src/abi_testing.cpp \
            libexpcache/src/errors.cpp libexpcache/src/log.cpp libexpcache/src/config.cpp \
            libexpcache/src/device_arena.cpp libexpcache/src/layers.cpp libexpcache/src/class_table.cpp \
            libexpcache/src/class_slots.cpp libexpcache/src/class_bank.cpp libexpcache/src/class_resize.cpp \
            libexpcache/src/stream_order.cpp libexpcache/src/prefetch_coordinator.cpp libexpcache/src/cache.cpp \
            libexpcache/src/slots.cpp libexpcache/src/serve.cpp libexpcache/src/serve_select.cpp \
            libexpcache/src/serve_compact.cpp libexpcache/src/serve_batch.cpp libexpcache/src/serve_device.cpp \
            libexpcache/src/serve_insert.cpp libexpcache/src/budget.cpp \
            libexpcache/src/device_lookup.cpp libexpcache/src/device_resize.cpp libexpcache/src/device_feed.cpp \
            libexpcache/src/feed.cpp libexpcache/src/host_pool.cpp libexpcache/src/serve_pool.cpp \
            libexpcache/src/kernels/lookup_kernels_host.cpp \
            libexpcache/src/prefetcher.cpp libexpcache/src/inspect.cpp libexpcache/src/paths.cpp \
            libexpcache/src/backend/host.cpp libexpcache/src/backend/staging_ring.cpp \
            libexpcache/src/backend/staging_backend.cpp \
            libexpcache/src/backend/source_file.cpp libexpcache/src/kernels/test_kernels_host.cpp $(POLICY_SRC)
# Every file of policy/: the table (registry.cpp) and one file per policy, so a new policy's file
# is built without an edit here.
POLICY_SRC = $(sort $(wildcard libexpcache/src/policy/*.cpp))
CUDA_SRC  = libexpcache/src/backend/cuda.cu libexpcache/src/kernels/checksum.cu libexpcache/src/kernels/spin.cu \
            libexpcache/src/kernels/test_kernels_cuda.cu libexpcache/src/kernels/lookup_kernels_cuda.cu
HEADERS   = $(wildcard libexpcache/include/*.h libexpcache/src/*.hpp libexpcache/src/*/*.hpp libexpcache/src/*/*.cuh)

CORE_OBJ  = $(patsubst libexpcache/src/%.cpp,$(BUILD)/obj/%.o,$(CORE_SRC))
CUDA_OBJ  = $(patsubst libexpcache/src/%.cu,$(BUILD)/obj/%.o,$(CUDA_SRC))
STUB_OBJ  = $(BUILD)/obj/backend/cuda_stub.o
GENCODE   = $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
            -gencode arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS))

# The CUDA runtime the CUDA library links: shared (the default, as ggml links it), so an engine
# and the library share one runtime (one set of errors and streams, and the driver floor the
# engine's), or static (no libcudart.so.13 needed at run time). The shared one is found through the
# library's runpath: its own folder, the CUDA runtime wheels' folders next to an installed package
# (nvidia/cu13/lib, nvidia/cuda_runtime/lib: the ones torch installs), then the toolkit it was
# built with (nvcc's library folder, CUDA_LIBDIR).
CUDART    ?= shared
CUDA_LIBDIR ?= $(if $(NVCC),$(realpath $(shell $(NVCC) --dryrun -x cu /dev/null 2>&1 | sed -n 's/.*"-L\([^"]*\)".*/\1/p' | head -n 1)))
CUDA_RUNPATH = '$$ORIGIN:$$ORIGIN/../nvidia/cu13/lib:$$ORIGIN/../nvidia/cuda_runtime/lib$(if $(CUDA_LIBDIR),:$(CUDA_LIBDIR))'
CUDART_LINK_shared = -Xlinker -rpath,$(CUDA_RUNPATH)

HOST_LIB  = $(BUILD)/libexpcache_host.so
CUDA_LIB  = $(BUILD)/libexpcache.so
REPLAY_LIB = $(BUILD)/libexpcache_replay.so
LIBS      = $(HOST_LIB) $(if $(NVCC),$(CUDA_LIB))

.PHONY: all lib deps deps-bench deps-lint test test-long bench lint format select-overhead copy-methods copy-handoff c-engine help clean
all: lib

help:
	@echo "make lib     build $(HOST_LIB) (g++), $(CUDA_LIB) when nvcc is found, and $(REPLAY_LIB)"
	@echo "make deps    install the Python packages the tests and benchmarks need, if missing (deps-bench: the benchmark's, deps-lint: ruff, clang-format)"
	@echo "make test    build, run the test suite in parallel (CUDA tests when a GPU is present) but the long tests"
	@echo "make test-long   the long tests (sanitizers, the wheel build, the fuzz machines' long run), the benchmarks once"
	@echo "make bench   build, then run the main benchmark (expcache bench) on the bundled trace"
	@echo "make lint    ruff (lint, format check) and clang-format (check) over the tracked sources; make format applies both"
	@echo "make select-overhead   host CPU time of an all-hit select of 6 experts, from C"
	@echo "make c-engine          $(BUILD)/c_engine, the example engine on the C ABI (examples/c_engine/README.md; needs nvcc, runs without a GPU)"
	@echo "make copy-handoff      who moves a device select's misses inside a graph: SMs, or the copy engine from a host thread (CUDA)"
	@echo "make copy-methods      ways to move a call's misses to the GPU, side by side (CUDA; COPY_TABLES=pinned,pageable,enqueue,host,link)"
	@echo "make asv-history / asv-quick / asv-record / asv-publish / asv-import-h200 / bench-quick: see benchmarks/README.md"
	@echo "make sanitize   the C stress driver under ASan+UBSan (asan-test), valgrind (valgrind-test) and TSan (tsan-test)"
	@echo "make clean   remove $(BUILD)/"
	@echo "variables: PYTHON=$(PYTHON) JOBS=$(JOBS) NVCC=$(NVCC) CUDA_ARCHS='$(CUDA_ARCHS)' CUDART=$(CUDART) BENCH_ARGS='...'"

lib: $(LIBS) $(REPLAY_LIB)

# The benchmark suite's C replay loop (expcache_bench/replay.c): it links nothing of
# libexpcache and is handed the loaded library's functions in a table; and the disk
# measurement's reader threads (expcache_bench/disk_reads.c).
REPLAY_SRCS = expcache_bench/replay.c expcache_bench/disk_reads.c
$(REPLAY_LIB): $(REPLAY_SRCS) libexpcache/include/expcache.h libexpcache/include/expcache_testing.h
	@mkdir -p $(BUILD)
	$(CC) -O2 -std=c11 -fPIC -shared -Wall -Ilibexpcache/include -Wl,--no-undefined -o $@ $(REPLAY_SRCS) -lpthread

$(BUILD)/obj/%.o: libexpcache/src/%.cpp $(HEADERS)
	@mkdir -p $(dir $@)
	$(CXX) $(COMMON) $(CXXFLAGS) $(WARN) -c $< -o $@

$(BUILD)/obj/%.o: libexpcache/src/%.cu $(HEADERS)
	@mkdir -p $(dir $@)
	$(NVCC) -std=c++17 -O2 -Xcompiler -fPIC,-fvisibility=hidden -Ilibexpcache/include -Ilibexpcache/src $(GENCODE) -c $< -o $@

# --no-undefined: a source left out of CORE_SRC fails the link here, not the library's load.
$(HOST_LIB): $(CORE_OBJ) $(STUB_OBJ)
	$(CXX) -shared -Wl,--no-undefined -o $@ $^ -lpthread

$(CUDA_LIB): $(CORE_OBJ) $(CUDA_OBJ)
	$(NVCC) -shared -Xlinker --no-undefined -cudart $(CUDART) $(CUDART_LINK_$(CUDART)) -o $@ $^ -lpthread

SELECT_BIN = $(BUILD)/select_overhead
$(SELECT_BIN): benchmarks/c/select_overhead.c $(LIBS)
	$(CC) -O2 -Ilibexpcache/include -o $@ $< -L$(BUILD) -l:$(notdir $(lastword $(LIBS))) -Wl,-rpath,'$$ORIGIN'

select-overhead: $(SELECT_BIN)
	$(SELECT_BIN) host 1000000 lru
	$(SELECT_BIN) host 1000000 oppclass
	$(SELECT_BIN) host 1000000 duel
	@if [ -n "$(NVCC)" ] && $(SELECT_BIN) cuda 1 >/dev/null 2>&1; then \
		$(SELECT_BIN) cuda 1000000 lru; $(SELECT_BIN) cuda 1000000 oppclass; $(SELECT_BIN) cuda 1000000 duel; fi

# The example engine (examples/c_engine/): CUDA C++ by nvcc and its GGUF loader in C, linked against
# $(CUDA_LIB) and the shared cudart, both found through the runpath the library has ($$ORIGIN first).
# Without a CUDA device it runs on the library's host backend.
C_ENGINE_BIN = $(BUILD)/c_engine
C_ENGINE_DIR = examples/c_engine
$(BUILD)/obj/c_engine/gguf.o: $(C_ENGINE_DIR)/gguf.c $(C_ENGINE_DIR)/gguf.h
	@mkdir -p $(dir $@)
	$(CC) -O2 -std=c11 -Wall -Wextra -c $< -o $@

$(C_ENGINE_BIN): $(C_ENGINE_DIR)/engine.cu $(C_ENGINE_DIR)/gguf.h $(BUILD)/obj/c_engine/gguf.o $(CUDA_LIB) libexpcache/include/expcache.h
	@test -n "$(NVCC)" || { echo "c-engine: needs nvcc (the engine is CUDA C++; it runs without a GPU on the host backend)"; exit 1; }
	$(NVCC) -std=c++17 -O2 $(GENCODE) -Xcompiler -Wall -Ilibexpcache/include -o $@ $< $(BUILD)/obj/c_engine/gguf.o \
		-L$(BUILD) -l:$(notdir $(CUDA_LIB)) -cudart shared $(CUDART_LINK_shared) -lpthread

c-engine: $(C_ENGINE_BIN)

COPY_BIN = $(BUILD)/copy_methods
$(COPY_BIN): benchmarks/c/copy_methods.cu benchmarks/c/cuda_check.hpp libexpcache/src/backend/copy_nt.hpp
	@test -n "$(NVCC)" || { echo "copy-methods: needs nvcc and a GPU"; exit 1; }
	@mkdir -p $(BUILD)
	$(NVCC) -std=c++17 -O2 $(GENCODE) -Ilibexpcache/src -o $@ $< -lpthread

COPY_TABLES ?= pinned,pageable,enqueue,host,link
copy-methods: $(COPY_BIN)
	$(COPY_BIN) 1 $(COPY_TABLES)

HANDOFF_BIN = $(BUILD)/copy_handoff
$(HANDOFF_BIN): benchmarks/c/copy_handoff.cu benchmarks/c/cuda_check.hpp
	@test -n "$(NVCC)" || { echo "copy-handoff: needs nvcc and a GPU"; exit 1; }
	@mkdir -p $(BUILD)
	$(NVCC) -std=c++17 -O2 $(GENCODE) -o $@ $< -lpthread

copy-handoff: $(HANDOFF_BIN)
	$(HANDOFF_BIN)

# What `make bench` needs: numpy and tabulate, and on a GPU machine (nvcc found and
# `nvidia-smi -L` lists a GPU) cuda-python (the `cuda` extra). `make deps` adds the test
# and benchmark tools. Each is a no-op when everything is there.
deps-bench:
	@$(PYTHON) -c "import numpy, tabulate" 2>/dev/null || $(PYTHON) -m pip install -q -e .
	@if [ -n "$(NVCC)" ] && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
		$(PYTHON) -c "from cuda.bindings import runtime" 2>/dev/null || \
		$(PYTHON) -c "from cuda import cudart" 2>/dev/null || \
		$(PYTHON) -m pip install -q -e ".[cuda]"; fi

deps: deps-bench
	@$(PYTHON) -c "import numpy, tabulate, pytest, xdist, pytest_benchmark, hypothesis, gguf, asv" 2>/dev/null || \
		$(PYTHON) -m pip install -q -e ".[test]"

# pytest on $(JOBS) xdist workers; tests/ uses no benchmark fixture: pytest-benchmark is left out (under
# xdist it would only warn that it is disabled).
PYTEST_PARALLEL = $(PYTHON) -m pytest -q -p no:benchmark -n $(JOBS)

# The test suite but the tests marked long, on $(JOBS) pytest-xdist workers (a test file to a worker:
# module fixtures are made once), the fuzz machines with hypothesis' quick profile (tests/conftest.py).
test: deps
	@$(MAKE) --no-print-directory -j$(JOBS) lib
	$(PYTEST_PARALLEL) --dist loadfile -m "not long" tests

# What CI runs after make test: the tests marked long (the C stress driver and unit tests under
# ASan+UBSan, TSan and valgrind, one worker per sanitizer's build folder; the wheel's build), the fuzz
# machines again with the long profile, then the benchmarks in quick mode (once each, host backend)
# so they cannot rot.
test-long: deps
	@$(MAKE) --no-print-directory -j$(JOBS) lib
	$(PYTEST_PARALLEL) --dist loadgroup -m "long or fuzz" --hypothesis-profile=long tests
	$(MAKE) --no-print-directory bench-quick

bench: lib deps-bench
	$(PYTHON) -m expcache_bench bench $(BENCH_ARGS)

# Lint and format: ruff for Python (its settings in pyproject.toml), clang-format (.clang-format)
# for the C/C++/CUDA files git tracks, so build/ and anything untracked stay out. pip install
# -e ".[lint]" installs both at the versions the tree is formatted with: another clang-format
# major formats differently.
RUFF         ?= $(PYTHON) -m ruff
CLANG_FORMAT ?= clang-format
C_SOURCES     = $(shell git ls-files '*.c' '*.cpp' '*.h' '*.hpp' '*.cu' '*.cuh')

deps-lint:
	@$(RUFF) --version >/dev/null 2>&1 && $(CLANG_FORMAT) --version >/dev/null 2>&1 || \
		$(PYTHON) -m pip install -q -e ".[lint]"

# The versions first: a failure from another clang-format major or ruff minor than the lint
# extra's reads as a format difference.
lint: deps-lint
	@$(RUFF) --version && $(CLANG_FORMAT) --version
	$(RUFF) check .
	$(RUFF) format --check .
	@test -n "$(C_SOURCES)" || { echo "lint: git ls-files lists no C/C++/CUDA source (not a git checkout?)"; exit 1; }
	@echo "$(CLANG_FORMAT) --dry-run --Werror <$(words $(C_SOURCES)) tracked C/C++/CUDA files>"
	@$(CLANG_FORMAT) --dry-run --Werror $(C_SOURCES)

# What `make lint` checks, applied: ruff's safe fixes (import order among them), ruff format, clang-format -i.
format: deps-lint
	$(RUFF) check --fix-only .
	$(RUFF) format .
	@test -n "$(C_SOURCES)" || { echo "format: git ls-files lists no C/C++/CUDA source (not a git checkout?)"; exit 1; }
	@echo "$(CLANG_FORMAT) -i <$(words $(C_SOURCES)) tracked C/C++/CUDA files>"
	@$(CLANG_FORMAT) -i $(C_SOURCES)

clean:
	rm -rf $(BUILD)

include benchmarks/asv.mk
include tests/sanitize.mk
