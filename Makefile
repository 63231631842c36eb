# Conveyor: the two commands are `make run` (the whole stack) and `make test` (the whole suite).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run test test-fast test-e2e test-bench test-deploy test-all bench bench-full lint docs chromium clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build of 2.13.0 where it is on disk, PyPI's otherwise.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The browser test of the playground uses the system's Chromium; install it where we can (Debian or
# Ubuntu, as root), and go on without it elsewhere: that test then skips and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    (apt-get install -y -qq chromium >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)) ; } || \
	  echo "chromium not installed: the playground's browser test will skip"

# A laptop's stack: no authentication, on 127.0.0.1 (`conveyor up` warns); CONVEYOR_AUTH=keys closes it.
# Its one user, `anonymous`, may use every priority class and sees all of /readyz.
run: $(STAMP)
	$(BIN)/conveyor model pull
	CONVEYOR_ADMIN_TENANTS=$${CONVEYOR_ADMIN_TENANTS:-'["anonymous"]'} \
	CONVEYOR_TENANT_PRIORITIES=$${CONVEYOR_TENANT_PRIORITIES:-'{"anonymous": ["realtime", "high", "normal", "batch"]}'} \
	CONVEYOR_AUTH=$${CONVEYOR_AUTH:-none} $(BIN)/conveyor up

# The gate, in two lanes at once. The in-process tests (the stack itself in process: tests/harness.py),
# the slow ones on the real models included, run in TEST_WORKERS processes (pytest-xdist; each has its
# own embedded Redis when REDIS_URL is unset). Beside them, in the background, mypy and then the e2e
# tier (whole `conveyor up` stacks: SIGKILL, supervisor, --only hosts, Redis outage, README, browser)
# one test at a time: its stacks wait on heartbeats, restarts and timeouts more than they compute, so
# the lanes share the two cores instead of taking turns. The background lane's output is printed when
# both are done (and kept in .e2e.log). The bench/ and deployment-manifest tests have targets of their
# own (test-bench, test-deploy). Each lane ends with its ten slowest tests (setup, call, teardown):
# where the gate's time goes, every run.
TEST_WORKERS ?= 2
# The Python processes started here (the tests' xdist workers and e2e lane, every stack's children)
# reuse the compiled bytecode of what they import: where the environment turns the cache off
# (PYTHONDONTWRITEBYTECODE), pytest rewrote the asserts of ~500 modules in each process again, 16 s.
unexport PYTHONDONTWRITEBYTECODE
SLOWEST := --durations=10
APART  := not bench and not deploy
FAST   := -m "not slow and not e2e and $(APART)"
INPROC := -m "not e2e and $(APART)"
E2E    := -m "e2e and $(APART)"
LATE   := -m "(slow or e2e) and $(APART)"

test: $(STAMP) chromium
	$(BIN)/ruff check app tests bench
	@{ $(BIN)/mypy; lint=$$?; $(BIN)/python -m pytest $(SLOWEST) $(E2E); e2e=$$?; \
	   echo "mypy exit $$lint, e2e tier exit $$e2e"; [ $$lint = 0 ] && [ $$e2e = 0 ]; } > .e2e.log 2>&1 & \
	lane=$$!; \
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(SLOWEST) $(INPROC); inproc=$$?; \
	wait $$lane; lane=$$?; \
	echo "===== mypy and the e2e tier ====="; cat .e2e.log; \
	[ $$inproc = 0 ] && [ $$lane = 0 ]

# The in-process tier alone: the logic and the stack in process, on a real Redis.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(FAST)

# The whole-stack and real-model tests alone, one at a time.
test-e2e: $(STAMP) chromium
	$(BIN)/python -m pytest $(LATE)

# bench/'s own tests (its load library, report, suite and naive server): no model, no stack.
test-bench: $(STAMP)
	$(BIN)/python -m pytest -m bench

# The deployment manifests (docker-compose.yml, deploy/k8s, the Prometheus rules, the dashboard),
# validated offline against their schemas.
test-deploy: $(STAMP)
	$(BIN)/python -m pytest -m deploy

# Everything: the gate, then the bench/ and deployment tests.
test-all: test test-bench test-deploy

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/conveyor model pull
	$(BIN)/python -m bench.suite --quick

bench-full: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/conveyor model pull
	$(BIN)/python -m bench.suite

lint: $(STAMP)
	$(BIN)/ruff check app tests bench
	$(BIN)/mypy

# The generated reference pages; tests/unit/test_config_doc.py and test_openapi_doc.py fail until they are current.
docs: $(STAMP)
	$(BIN)/conveyor docs config --out docs/configuration.md
	$(BIN)/conveyor docs openapi --out docs/openapi.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
