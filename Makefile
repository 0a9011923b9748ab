# The front door. `make install` builds .venv; `make test` runs everything, Docker included.
# A system Python is preferred: as root, local sandboxes run as unprivileged uids that must be
# able to read the interpreter (pyenv's under /root is out of their reach).
PYTHON ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test unit lint format demo image engine serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[server,kernel,languages,dev]'
	touch $@

# The Docker tests need an engine and the images: start and build them when we can. Where no
# engine can be had, the Docker tests skip on a developer's machine and fail in CI (CI=true).
test: install
	@if scripts/ensure-docker-engine.sh; then $(MAKE) --no-print-directory image; \
	else echo "warning: no Docker engine: the Docker tests cannot run" >&2; fi
	$(BIN)/pytest --numprocesses=auto --maxprocesses=4 --dist=loadfile

# The fast tier: pure modules only (no bwrap, no Docker, no kernel, no server), in seconds.
unit: install
	$(BIN)/pytest tests/unit -q

engine:
	scripts/ensure-docker-engine.sh

# Seconds when nothing changed: each image carries the hash of what it was built from.
image: install engine
	$(BIN)/code-interpreter image build

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The HTTP service on 127.0.0.1:8000 with the local backend and auth off: for one user only.
serve: install
	CODE_INTERPRETER_AUTH_DISABLED=true $(BIN)/code-interpreter serve --host 127.0.0.1 --port 8000

# Latencies beside the raw jupyter_client baseline, same run; writes bench/results/latest.*
bench: install
	@scripts/ensure-docker-engine.sh && $(MAKE) --no-print-directory image || true
	$(BIN)/python -m bench.run

demo: install
	$(BIN)/code-interpreter run -f examples/quickstart.py --output-dir outputs

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
