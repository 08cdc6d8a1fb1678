# Fleetwise: the README's two commands.
#   make demo  - create .venv if missing, install the package, run `fleetwise demo`
#   make test  - create/update .venv with all extras, start Apache Kafka, run pytest, stop Kafka
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
KAFKA_DIR ?= $(CURDIR)/.kafka-run
KUBE_DIR ?= $(CURDIR)/build/kube-run
PYTEST_ARGS ?=

.PHONY: demo test venv venv-all lint kafka-start kafka-stop clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

CONSTRAINTS := deploy/constraints.txt

# Installs are stamped by pyproject.toml, the pinned versions (deploy/constraints.txt, why
# there) and the C sources (compiled by the install) so an unchanged checkout skips pip.
BUILD_INPUTS := pyproject.toml setup.py $(CONSTRAINTS) $(wildcard fleetwise/*/*.c)
$(VENV)/.installed-core: $(BUILD_INPUTS) | $(PY)
	$(PIP) install -q -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.installed-all: $(BUILD_INPUTS) | $(PY)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[all]'
	touch $@ $(VENV)/.installed-core

venv: $(VENV)/.installed-core
venv-all: $(VENV)/.installed-all

demo: venv
	$(VENV)/bin/fleetwise demo

# The broker is stopped whatever pytest returns; pytest's status is make's status.
# etcd + kube-apiserver (+ kube-controller-manager) for the Kubernetes tests: built from the Go
# module proxy on first use (minutes; cached under ~/.cache/fleetwise/), stopped whatever pytest
# returns. If it cannot start, the kube tests' fixture says why (the other tests still run).
test: venv-all
	@bash deploy/kafka/kafka.sh start $(KAFKA_DIR) >/dev/null
	-@bash deploy/prometheus/install-prometheus.sh >/dev/null
	-@bash deploy/helm/build-helm.sh >/dev/null
	-@bash deploy/kube/kube.sh start $(KUBE_DIR) >/dev/null
	@status=0; \
	FLEETWISE_KAFKA_BOOTSTRAP=$$(bash deploy/kafka/kafka.sh bootstrap $(KAFKA_DIR)) \
	FLEETWISE_KUBECONFIG=$$(bash deploy/kube/kube.sh kubeconfig $(KUBE_DIR) 2>/dev/null) \
	  $(PY) -m pytest $(PYTEST_ARGS) || status=$$?; \
	bash deploy/kube/kube.sh stop $(KUBE_DIR) >/dev/null; \
	bash deploy/kafka/kafka.sh stop $(KAFKA_DIR) >/dev/null; \
	exit $$status

lint: venv-all
	$(VENV)/bin/ruff check fleetwise tests bench

kafka-start: venv
	bash deploy/kafka/kafka.sh start $(KAFKA_DIR)

kafka-stop:
	bash deploy/kafka/kafka.sh stop $(KAFKA_DIR)

clean:
	rm -rf $(VENV) $(KAFKA_DIR) .pytest_cache .ruff_cache *.egg-info build fleetwise/*/*.so
