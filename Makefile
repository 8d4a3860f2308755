# rankscope: `make demo` (local stack + demo job) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
WHEELHOUSE ?= $(HOME)/.cache/rankscope/wheels
export RANKSCOPE_DATA_DIR ?= $(CURDIR)/.rankscope
PYTEST_ARGS ?=

.PHONY: install native browser kafka-jars demo up down status test bench lint clean

install: $(BIN)/.installed

# One install per requirements change. Wheels are kept in $(WHEELHOUSE) so a fresh clone does not
# download torch (several GB) again: `pip download` skips files already there.
$(BIN)/.installed: pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	mkdir -p $(WHEELHOUSE)
	$(BIN)/pip download -q -d $(WHEELHOUSE) -r requirements.lock || echo "pip download incomplete; installing from the index"
	$(BIN)/pip install -q --no-index --find-links $(WHEELHOUSE) -r requirements.lock || $(BIN)/pip install -q -r requirements.lock
	$(BIN)/pip install -q --no-deps --no-build-isolation -e . || $(BIN)/pip install -q --no-deps -e .
	touch $@

# The C++ trace-window reader (producers/native/), built once per torch version into the cache dir;
# without a compiler ranks use the Python reader (tests/producers/test_native_extract.py fails).
native: install
	$(BIN)/rankscope build-native --optional

# Debian's chromium for the browser tests (root on CI and dev machines).
browser:
	@test -x /usr/bin/chromium || { apt-get update -q && apt-get install -y -q chromium; }

kafka-jars: install
	$(BIN)/python -c "from rankscope.cli.stack.broker import LocalBroker; from rankscope.config import Settings; LocalBroker(Settings.from_env()).ensure_jars()"

demo: install native kafka-jars
	$(BIN)/rankscope demo

up: install native kafka-jars
	$(BIN)/rankscope up

down:
	-$(BIN)/rankscope down

status:
	$(BIN)/rankscope status

test: install native kafka-jars browser
	WHEELHOUSE=$(WHEELHOUSE) $(BIN)/python tests/run_lanes.py $(PYTEST_ARGS)

bench: install native kafka-jars browser
	$(BIN)/python -m benchmarks

lint: install
	$(BIN)/ruff check rankscope producers stream_processors offline cli storage dashboard benchmarks tests
	$(BIN)/mypy rankscope producers stream_processors offline cli storage dashboard

clean: down
	rm -rf $(RANKSCOPE_DATA_DIR) .pytest_cache
