# The C stress driver (tests/c/stress/, described in its main.c) under sanitizers and valgrind, on the
# host backend (no GPU, no nvcc). Included from the repository's Makefile,
# which defines CC, CXX, BUILD, COMMON, WARN, HEADERS, CORE_SRC (the C++ core,
# host backend included) and STUB_OBJ; run from the repository root. To try
# it without the include: make -f Makefile -f tests/sanitize.mk asan-test
#
#   make asan-test       core + host backend + driver built with ASan and UBSan into
#                        $(BUILD)/asan/, statically linked into one executable, run
#                        with STRESS_SEED and STRESS_OPS (~25 s run, ~15 s build on 2 cores)
#   make valgrind-test   the same without sanitizers into $(BUILD)/valgrind/, a shorter
#                        run (VALGRIND_OPS, ~15 s) under valgrind's memcheck; skipped, with
#                        a message, when valgrind is not installed
#   make tsan-test       the same with ThreadSanitizer into $(BUILD)/tsan/, a shorter run
#                        (TSAN_OPS): the staging ring's threads against the calling thread
#   make sanitize        all three
#   make ring-test       tests/c/ring_test.cpp, a unit test of the staging ring over a fake link
#                        (transfers land only when waited for; refused transfers), with ASan
#                        and UBSan; make ring-tsan-test: the same with ThreadSanitizer
#   make prefetch-test   tests/c/prefetch_test.cpp, the prefetch thread over the same fake link,
#                        with ASan and UBSan; make prefetch-tsan-test: with ThreadSanitizer
#   make oppclass-test   tests/c/oppclass_count_test.cpp, OppClassLRU's class and decay of a count
#                        against the simulator's logarithm and power, with ASan and UBSan
#   make memory-test     tests/c/memory_test.c, memory kept past release_all and destroy by
#                        expcache_memory_retain, and a cache inherited by fork(), with ASan and UBSan
#
# The driver prints its counts and exits 1 on any divergence from the header's
# promises (each is printed with the seed and operation number); a sanitizer
# report ends the run at once. Reproduce or explore one seed, with a line per
# operation: $(BUILD)/asan/stress SEED OPS --trace. Other seeds:
# make asan-test STRESS_SEED=7. Source files for file-backed layers are made
# (and unlinked at once) in STRESS_TMPDIR.

# Whatever includes this keeps its own default goal (`make` alone still builds).
SANITIZE_MK_DEFAULT_GOAL := $(.DEFAULT_GOAL)

STRESS_SEED   ?= 20240611
STRESS_OPS    ?= 80000
VALGRIND_OPS  ?= 4000
TSAN_OPS      ?= 20000
VALGRIND      ?= valgrind
VALGRIND_EXTRA ?=
SAN_OPT       ?= -O1 -g
SAN_FLAGS      = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
# A 64 MiB quarantine keeps the run near 0.5 GB of memory (the default 256 MiB: ~1.1 GB).
SAN_ENV        = ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:abort_on_error=0:strict_string_checks=1:check_initialization_order=1:quarantine_size_mb=64 \
                 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# VALGRIND_EXTRA=--track-origins=yes says where an uninitialised value came from (1.5x slower).
VALGRIND_ARGS  = -q --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite,indirect \
                 --show-leak-kinds=definite,indirect $(VALGRIND_EXTRA)

# The C++ core with the host backend, plus the stub that stands in for the CUDA backend.
SAN_CXX_SRC   = $(CORE_SRC) $(patsubst $(BUILD)/obj/%.o,libexpcache/src/%.cpp,$(STUB_OBJ))
SAN_CXXFLAGS  = $(if $(COMMON),$(COMMON),-std=c++17 -Ilibexpcache/include -Ilibexpcache/src) $(WARN)
STRESS_SRC    = $(sort $(wildcard tests/c/stress/*.c))
STRESS_HDR    = tests/c/stress/stress.h libexpcache/include/expcache.h libexpcache/include/expcache_testing.h
STRESS_CFLAGS = -std=c11 -Wall -Wextra -Ilibexpcache/include

ASAN_DIR = $(BUILD)/asan
ASAN_BIN = $(ASAN_DIR)/stress
VG_DIR   = $(BUILD)/valgrind
VG_BIN   = $(VG_DIR)/stress
TSAN_DIR = $(BUILD)/tsan
TSAN_BIN = $(TSAN_DIR)/stress
TSAN_FLAGS = -fsanitize=thread -fno-omit-frame-pointer
TSAN_ENV   = TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1

.PHONY: asan-test valgrind-test tsan-test sanitize ring-test ring-tsan-test prefetch-test prefetch-tsan-test memory-test oppclass-test

sanitize: asan-test valgrind-test tsan-test

# $(call stress_build,DIR,FLAGS): the core, the host backend and the driver (every file of
# tests/c/stress/) compiled and linked with FLAGS into DIR/stress, one object per source: the
# core's under DIR/obj, the driver's under DIR/stress_obj.
define stress_build
$(1)/obj/%.o: libexpcache/src/%.cpp $$(HEADERS)
	@mkdir -p $$(dir $$@)
	$$(CXX) $$(SAN_CXXFLAGS) $$(SAN_OPT) $(2) -c $$< -o $$@

$(1)/stress_obj/%.o: tests/c/stress/%.c $$(STRESS_HDR)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(STRESS_CFLAGS) $$(SAN_OPT) $(2) -c $$< -o $$@

$(1)/stress: $$(patsubst tests/c/stress/%.c,$(1)/stress_obj/%.o,$$(STRESS_SRC)) \
		$$(patsubst libexpcache/src/%.cpp,$(1)/obj/%.o,$$(SAN_CXX_SRC))
	$$(CXX) $(2) -o $$@ $$^ -lpthread
endef
$(eval $(call stress_build,$(ASAN_DIR),$(SAN_FLAGS)))
$(eval $(call stress_build,$(VG_DIR),))
$(eval $(call stress_build,$(TSAN_DIR),$(TSAN_FLAGS)))

# The ring's unit test: the ring and what it uses, from the same objects as the stress driver.
RING_SRC = libexpcache/src/backend/staging_ring.cpp libexpcache/src/backend/source_file.cpp libexpcache/src/errors.cpp
define ring_build
$(1)/ring_test: tests/c/ring_test.cpp tests/c/fake_link.hpp $$(patsubst libexpcache/src/%.cpp,$(1)/obj/%.o,$$(RING_SRC)) $$(HEADERS)
	$$(CXX) $$(SAN_CXXFLAGS) $$(SAN_OPT) $(2) -o $$@ tests/c/ring_test.cpp \
		$$(patsubst libexpcache/src/%.cpp,$(1)/obj/%.o,$$(RING_SRC)) -lpthread
endef
$(eval $(call ring_build,$(ASAN_DIR),$(SAN_FLAGS)))
$(eval $(call ring_build,$(TSAN_DIR),$(TSAN_FLAGS)))

# The prefetch thread's unit test over the same fake link.
PREFETCH_SRC = libexpcache/src/prefetcher.cpp libexpcache/src/layers.cpp $(RING_SRC)
define prefetch_build
$(1)/prefetch_test: tests/c/prefetch_test.cpp tests/c/fake_link.hpp $$(patsubst libexpcache/src/%.cpp,$(1)/obj/%.o,$$(PREFETCH_SRC)) $$(HEADERS)
	$$(CXX) $$(SAN_CXXFLAGS) $$(SAN_OPT) $(2) -o $$@ tests/c/prefetch_test.cpp \
		$$(patsubst libexpcache/src/%.cpp,$(1)/obj/%.o,$$(PREFETCH_SRC)) -lpthread
endef
$(eval $(call prefetch_build,$(ASAN_DIR),$(SAN_FLAGS)))
$(eval $(call prefetch_build,$(TSAN_DIR),$(TSAN_FLAGS)))

# OppClassLRU's arithmetic of a count against the simulator's expressions: the policy's header
# and its one source file.
$(ASAN_DIR)/oppclass_count_test: tests/c/oppclass_count_test.cpp $(ASAN_DIR)/obj/policy/oppclass.o $(HEADERS)
	$(CXX) $(SAN_CXXFLAGS) $(SAN_OPT) $(SAN_FLAGS) -o $@ tests/c/oppclass_count_test.cpp $(ASAN_DIR)/obj/policy/oppclass.o

oppclass-test: $(ASAN_DIR)/oppclass_count_test
	$(SAN_ENV) $(ASAN_DIR)/oppclass_count_test

# The memory references' test: a C program over the public API, linked like the stress driver.
$(ASAN_DIR)/memory_test: tests/c/memory_test.c $(patsubst libexpcache/src/%.cpp,$(ASAN_DIR)/obj/%.o,$(SAN_CXX_SRC)) \
		libexpcache/include/expcache.h
	$(CC) $(STRESS_CFLAGS) $(SAN_OPT) $(SAN_FLAGS) -c tests/c/memory_test.c -o $(ASAN_DIR)/memory_test.o
	$(CXX) $(SAN_FLAGS) -o $@ $(ASAN_DIR)/memory_test.o \
		$(patsubst libexpcache/src/%.cpp,$(ASAN_DIR)/obj/%.o,$(SAN_CXX_SRC)) -lpthread

memory-test: $(ASAN_DIR)/memory_test
	$(SAN_ENV) $(ASAN_DIR)/memory_test

prefetch-test: $(ASAN_DIR)/prefetch_test
	$(SAN_ENV) $(ASAN_DIR)/prefetch_test

prefetch-tsan-test: $(TSAN_DIR)/prefetch_test
	$(TSAN_ENV) $(TSAN_DIR)/prefetch_test

ring-test: $(ASAN_DIR)/ring_test
	$(SAN_ENV) $(ASAN_DIR)/ring_test

ring-tsan-test: $(TSAN_DIR)/ring_test
	$(TSAN_ENV) $(TSAN_DIR)/ring_test

tsan-test: $(TSAN_BIN)
	$(TSAN_ENV) STRESS_TMPDIR=$(TSAN_DIR) $(TSAN_BIN) $(STRESS_SEED) $(TSAN_OPS)

asan-test: $(ASAN_BIN)
	$(SAN_ENV) STRESS_TMPDIR=$(ASAN_DIR) $(ASAN_BIN) $(STRESS_SEED) $(STRESS_OPS)

VALGRIND_FOUND := $(shell command -v $(VALGRIND) 2>/dev/null)
ifeq ($(VALGRIND_FOUND),)
valgrind-test:
	@echo "valgrind-test: skipped: $(VALGRIND) not found (apt-get install valgrind)"
else
valgrind-test: $(VG_BIN)
	STRESS_TMPDIR=$(VG_DIR) $(VALGRIND) $(VALGRIND_ARGS) $(VG_BIN) $(STRESS_SEED) $(VALGRIND_OPS)
endif

.DEFAULT_GOAL := $(SANITIZE_MK_DEFAULT_GOAL)
