# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create/reuse .venv and install the pinned set from constraints.txt.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Every extra (see pyproject.toml); vLLM (gpu) only where there is a GPU to run it.
EXTRAS ?= dev,diagnosis,eval,kubernetes,tracking$(shell command -v nvidia-smi >/dev/null 2>&1 && echo ,gpu)

.PHONY: demo test check unit integration venv clean slurm-packages sandbox-packages native-packages pgbouncer-packages

$(STAMP): pyproject.toml constraints.txt setup.py diagnosis/native/linescan.cc | native-packages
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH (set PY=... to override)"; exit 1; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/forgeflow demo

# The compressor's native line pass (diagnosis/native, built by pip through setup.py) links
# RE2's C++ library (Debian's libre2-dev; g++, pkg-config): as root, install them when missing,
# before pip builds the package. Without them the build skips the pass and the compressor
# runs its pure-Python scan (same result, slower; it says so once per process).
NATIVE_PKGS := g++ pkg-config libre2-dev
native-packages:
	@if [ "$$(id -u)" = 0 ] && ! { command -v g++ >/dev/null 2>&1 && command -v pkg-config >/dev/null 2>&1 && pkg-config --exists re2; } && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $(NATIVE_PKGS) (the compressor's native line pass)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq $(NATIVE_PKGS) >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $(NATIVE_PKGS) >/dev/null 2>&1; } || \
	  echo "could not install $(NATIVE_PKGS): the compressor runs its pure-Python scan"; \
	fi

# The Slurm integration tests run a real slurmctld/slurmd (Debian's slurm-wlm + munge): as
# root, install them when missing; otherwise those tests skip and say why.
SLURM_PKGS := slurm-wlm munge
slurm-packages:
	@if [ "$$(id -u)" = 0 ] && ! command -v slurmctld >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $(SLURM_PKGS) (Slurm integration tests)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq $(SLURM_PKGS) >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $(SLURM_PKGS) >/dev/null 2>&1; } || \
	  echo "could not install $(SLURM_PKGS): the Slurm tests will skip"; \
	fi

# The state database's pooling and failover tests and benchmark (testing/postgres_servers.py)
# put Debian's PgBouncer in front of the embedded PostgreSQL: as root, install it when missing;
# otherwise those tests skip and the benchmark's smoke fails saying what to install.
pgbouncer-packages:
	@if [ "$$(id -u)" = 0 ] && ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing pgbouncer (state database pooling tests)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq pgbouncer >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq pgbouncer >/dev/null 2>&1; } || \
	  echo "could not install pgbouncer: the pooling tests will skip"; \
	fi

# The HumanEval sandbox holds at the OS level with bubblewrap (Debian's bubblewrap): as root,
# install it when missing; without it, scoring HumanEval refuses (isolation: python-guard is
# the explicit opt-in for trusted code).
sandbox-packages:
	@if [ "$$(id -u)" = 0 ] && ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing bubblewrap (OS-level HumanEval sandbox)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } || \
	  echo "could not install bubblewrap: HumanEval scoring will refuse to run (the bubblewrap tests skip)"; \
	fi

# Three pytest-xdist workers on a 2-core box: most integration tests wait on servers, process
# start-up and their drills' timeouts, so with two workers the cores sat idle a quarter of the
# time (measured: 71% busy, 21.8 min); a third fills them (83% busy, 20.4 min; one process: 31
# min). tests/xdist_schedule.py (xdist's own loadgroup does not group under pytest 9.2) keeps
# each integration file on one worker (its servers start once) and the Slurm tests together,
# and starts the longest first (durations of the last run, from .pytest_cache) so that the
# workers finish together.
TEST_WORKERS ?= 3
test: $(STAMP) slurm-packages sandbox-packages pgbouncer-packages
	$(BIN)/python -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadgroup tests

# For use while working (under 5 minutes on 2 cores): the unit tests and the integration tests
# that need no Prefect server, Slurm or training run, less the few marked slow; `make test`
# before a commit runs everything.
CHECK_PATHS := tests/unit tests/integration/orchestrator tests/integration/diagnosis \
	tests/integration/notify tests/integration/launch
check: $(STAMP) sandbox-packages pgbouncer-packages
	$(BIN)/python -m pytest -q -ra -m "not slow" -n $(TEST_WORKERS) --dist loadgroup $(CHECK_PATHS)

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

integration: $(STAMP) slurm-packages sandbox-packages pgbouncer-packages
	$(BIN)/python -m pytest -q tests/integration

clean:
	rm -rf $(VENV) .forgeflow runs
