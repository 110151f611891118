# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create/reuse .venv and install the pinned set from constraints.txt.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test unit integration venv clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH (set PY=... to override)"; exit 1; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/forgeflow demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra tests

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

clean:
	rm -rf $(VENV) .forgeflow runs
