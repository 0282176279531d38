# Each target's line in `make help` is its `## ` comment.
VENV ?= .venv

.PHONY: help setup demo test check lint fmt bench
help:  ## this list: every target and what it does
	@awk -F ':.*## ' '/^[a-z][a-z-]*:.*## / {printf "  make %-7s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: $(VENV)/.numa-engram-installed  ## install into .venv: libnuma, a C compiler, clang-format, torch (CPU), the package and its test tools

# installed again only when what the install reads changed (or a fresh clone)
$(VENV)/.numa-engram-installed: pyproject.toml setup.py tools/setup.sh $(wildcard cffi_build/*) \
		$(wildcard cffi_build/src/*)
	VENV=$(VENV) tools/setup.sh
	touch $@

demo: setup  ## the main job on a default table (numa-engram topo, then numa-engram demo)
	$(VENV)/bin/numa-engram topo
	$(VENV)/bin/numa-engram demo

test: setup  ## every test: the host suite with lint and the package, sanitizer and lower-bounds checks beside it, then the NUMA guests
	PYTHON=$(VENV)/bin/python tools/test.sh

check: setup  ## the fast lane: lint beside the tests that start no process world, no ~1 s interpreter and no guest
	PYTHON=$(VENV)/bin/python tools/check.sh

lint: setup  ## the static checks alone: ruff, the C core's format and warnings, mypy, the layer contract
	PYTHON=$(VENV)/bin/python tools/lint.sh

fmt: setup  ## imports sorted (ruff) and the C core formatted (clang-format) in place
	PYTHON=$(VENV)/bin/python tools/lint.sh --fix

bench: setup  ## the benchmarks (ratios to a baseline measured in the same run)
	$(VENV)/bin/python tools/bench.py
