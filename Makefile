# clusterctl — two set-up commands on a fresh Debian machine:
#   make demo   start a local testbed cluster and run clusterctl against it
#   make test   run the test suite (make test-fast: the quick part of it, for while you work)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= .demo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps venv install test test-fast lint demo demo-down demo-failover llama-server bench dist clean

all: test

# System packages (root only; a non-root user installs openssh-server once by hand).
deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  need=""; \
	  [ -x /usr/sbin/sshd ] || need="$$need openssh-server"; \
	  command -v ssh >/dev/null || need="$$need openssh-client"; \
	  command -v ip >/dev/null || need="$$need iproute2"; \
	  command -v cmake >/dev/null || need="$$need cmake"; \
	  command -v g++ >/dev/null || need="$$need g++"; \
	  command -v busybox >/dev/null || need="$$need busybox"; \
	  command -v mksh >/dev/null || need="$$need mksh"; \
	  $(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || need="$$need python3-venv"; \
	  if [ -n "$$need" ]; then \
	    echo "installing:$$need" >&2; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need >/dev/null; \
	  fi; \
	fi

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

venv: $(PY)

# Installed once per change of pyproject.toml (an editable install: code changes need none),
# so that later runs need no package index.
$(VENV)/.installed: pyproject.toml | $(PY)
	@$(PY) -m pip install -q -e '.[test]'
	@touch $@

install: deps $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check cluster_cli testbed tests bench scripts
	$(VENV)/bin/ruff format --check cluster_cli testbed tests bench scripts

llama-server: install
	@PYTHON=$(abspath $(PY)) bash scripts/install-llama-server.sh >/dev/null

test: install llama-server
	$(VENV)/bin/ruff check cluster_cli testbed tests bench scripts
	$(VENV)/bin/ruff format --check cluster_cli testbed tests bench scripts
	LLAMA_SERVER="$$(PYTHON=$(abspath $(PY)) bash scripts/install-llama-server.sh)" $(PY) -m pytest -q -p no:cacheprovider

# The quick loop while working: lint, and the tests that need neither the SSH testbed nor a
# llama-server (marker e2e), wait on no real timeouts (slow) and are no property tests with
# hundreds of examples (hypothesis). `make test` is the whole suite.
test-fast: install
	$(VENV)/bin/ruff check cluster_cli testbed tests bench scripts
	$(VENV)/bin/ruff format --check cluster_cli testbed tests bench scripts
	$(PY) -m pytest -q -p no:cacheprovider -m "not e2e and not slow and not hypothesis"

demo: install
	@bash scripts/demo.sh

demo-down:
	-@DEMO_DIR=$(DEMO_DIR) bash scripts/demo.sh down

# A node killed under load, and supervise healing the cluster (about a minute).
demo-failover: install llama-server
	LLAMA_SERVER="$$(PYTHON=$(abspath $(PY)) bash scripts/install-llama-server.sh)" $(PY) scripts/demo_failover.py

bench: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/discover.py
	$(PY) bench/placement.py

# dist/clusterctl: one executable file (the interpreter and every dependency; a PyInstaller onedir
# bundle that unpacks itself once into ~/.cache/clusterctl/bin), and the wheel and sdist beside it
# (scripts/build-dist.sh). bash scripts/dist-smoke.sh tests the binary alone.
dist: $(VENV)/.installed
	@$(PY) -c 'import PyInstaller, build' 2>/dev/null || $(PY) -m pip install -q -e '.[dist]'
	PY=$(PY) bash scripts/build-dist.sh

clean: demo-down
	rm -rf $(VENV) .clusterctl build dist *.egg-info
