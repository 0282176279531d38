# make demo  - install into .venv and run the main job on a default table
# make test  - install into .venv and run every test (NUMA ones in the VM)
# make check - the fast lane: lint, types and the tests without processes or guests
VENV ?= .venv

.PHONY: setup demo test check bench
setup: $(VENV)/.numa-engram-installed

# installed again only when what the install reads changed (or a fresh clone)
$(VENV)/.numa-engram-installed: pyproject.toml setup.py tools/setup.sh $(wildcard cffi_build/*) \
		$(wildcard cffi_build/src/*)
	VENV=$(VENV) tools/setup.sh
	touch $@

demo: setup
	$(VENV)/bin/numa-engram topo
	$(VENV)/bin/numa-engram demo

test: setup
	PYTHON=$(VENV)/bin/python tools/test.sh

check: setup
	PYTHON=$(VENV)/bin/python tools/check.sh

bench: setup
	$(VENV)/bin/python tools/bench.py
