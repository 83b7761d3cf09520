# Benchmark history (asv) and micro-benchmark (pytest-benchmark) targets.
# Included from the repository's Makefile (`include benchmarks/asv.mk`), which
# defines PYTHON, BUILD and the `lib` target; run from the repository root.
# See benchmarks/README.md. asv's configuration is benchmarks/asv.conf.json (ASV_CONF),
# its suites the package benchmarks/benchmarks/; every asv command gets --config.
#
#   make asv-history    asv over the last ASV_COMMITS commits (one virtualenv, a build per
#                       commit), then publish the HTML to .asv/html
#   make asv-quick      every asv benchmark once on the working tree, in this Python
#                       (nothing saved)
#   make asv-record     the whole asv suite on the working tree in this Python, saved as
#                       HEAD's results for this machine (the GPU machine: no internet)
#   make asv-publish    .asv/results -> .asv/html (every machine's results found there)
#   make asv-import-h200  the H200's record kept in benchmarks/results/asv_h200 copied into
#                       .asv/results/h200 (requirements the matrix no longer lists dropped,
#                       so its graphs continue the same lines), then published
#   make bench-quick    CI: the pytest-benchmark file (benchmarks/test_micro.py) once as
#                       tests, `asv check` and a quick dry run of every asv benchmark
#                       (host backend)

# Whatever includes this keeps its own default goal (`make` alone still builds).
ASV_MK_DEFAULT_GOAL := $(.DEFAULT_GOAL)

ASV         ?= $(PYTHON) -m asv
ASV_CONF    ?= benchmarks/asv.conf.json
ASV_COMMITS ?= 5
ASV_MACHINE ?=
ASV_LAUNCH  ?=
ASV_ARGS    ?=
# asv-history leaves commits alone that already have results; ASV_SKIP= re-runs them
# (e.g. after a benchmark changed: asv does not re-run old commits by itself).
ASV_SKIP    ?= --skip-existing

ASV_CONF_ARG    = --config $(ASV_CONF)
ASV_MACHINE_ARG = $(if $(ASV_MACHINE),--machine $(ASV_MACHINE))
ASV_LAUNCH_ARG  = $(if $(ASV_LAUNCH),--launch-method $(ASV_LAUNCH))

.PHONY: asv-deps asv-machine asv-history asv-quick asv-record asv-publish asv-import-h200 bench-quick

asv-deps:
	@$(PYTHON) -c "import asv, pytest_benchmark" 2>/dev/null || \
		$(PYTHON) -m pip install -q "asv>=0.6" "pytest-benchmark>=4"

# Writes ~/.asv-machine.json (asv asks interactively otherwise). ASV_MACHINE names the
# machine (default: the host name); results go to .asv/results/<machine>/.
asv-machine: asv-deps
	@$(ASV) machine $(ASV_CONF_ARG) --yes $(ASV_MACHINE_ARG) >/dev/null

# The last ASV_COMMITS commits of HEAD, each built by benchmarks/asv.conf.json's build_command
# (make lib + a wheel) in .asv/env. Results already there are not run again. Commits
# that do not build (before pyproject.toml) and benchmarks that fail show as gaps: asv
# then exits non-zero, which `-` lets pass so that the rest is still published.
asv-history: asv-machine
	-$(ASV) run $(ASV_CONF_ARG) $(ASV_MACHINE_ARG) $(ASV_LAUNCH_ARG) $(ASV_SKIP) "HEAD --max-count=$(ASV_COMMITS)" \
		$(ASV_ARGS)
	$(ASV) publish $(ASV_CONF_ARG)
	@echo "asv-history: open .asv/html/index.html, or run: $(ASV) preview $(ASV_CONF_ARG)"

asv-quick: lib asv-machine
	$(ASV) run $(ASV_CONF_ARG) --python=same --quick --show-stderr $(ASV_MACHINE_ARG) $(ASV_LAUNCH_ARG) $(ASV_ARGS)

# On the GPU machine: make lib && make asv-record ASV_MACHINE=h200 (spawn: each benchmark
# process starts clean, nothing CUDA is inherited). Then copy .asv/results/h200 back.
asv-record: lib asv-machine
	@git diff --quiet HEAD -- libexpcache pyexpcache Makefile $(ASV_CONF) || \
		echo "asv-record: warning: the working tree differs from HEAD; its results are saved as HEAD's"
	$(ASV) run $(ASV_CONF_ARG) --python=same --set-commit-hash HEAD --launch-method $(or $(ASV_LAUNCH),spawn) \
		$(ASV_MACHINE_ARG) $(ASV_ARGS)

asv-publish: asv-deps
	$(ASV) publish $(ASV_CONF_ARG)

asv-import-h200: asv-deps
	$(PYTHON) benchmarks/asv_import.py benchmarks/results/asv_h200 .asv/results/h200
	$(ASV) publish $(ASV_CONF_ARG)

bench-quick: lib asv-machine
	$(PYTHON) -m pytest benchmarks/test_micro.py --benchmark-disable -q -p no:cacheprovider
	$(ASV) check $(ASV_CONF_ARG) --python=same
	$(ASV) run $(ASV_CONF_ARG) --python=same --quick --dry-run $(ASV_MACHINE_ARG) $(ASV_ARGS)

.DEFAULT_GOAL := $(ASV_MK_DEFAULT_GOAL)
