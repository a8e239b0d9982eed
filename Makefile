# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# torch is installed first and pinned: on these machines torch==2.13.0 is a CPU wheel on local
# disk, while any other request would pull a multi-GB CUDA build. The package itself only asks
# for torch>=2.4, which the pinned wheel satisfies, so pip installs nothing more.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test setup lint bench clean

# pip byte-compiles what it installs one file at a time; it is told not to, and the environment is
# compiled once afterwards on every core (the same files, in a fraction of the time on two or more).
# A file that does not compile on this Python (a library's test fixture written for a newer one) is
# left as it is, as pip leaves it: hence `|| true`.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile -e ".[hf,dev]"
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/batchfit demo

# The suite runs on every core up to four (pytest-xdist): CI's two cores halve its time. Its tests take from a
# hundredth of a second to half a minute, so a worker that runs out of tests takes some of another's queue
# (`--dist worksteal`) instead of idling while the other finishes the long ones it was handed.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4 --dist worksteal

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

bench: $(STAMP)
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
