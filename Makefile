# The two entry points of the README: `make demo` and `make test`.
# Both install missing Debian packages and the pinned PyPI packages (.venv) first, then
# configure and build in Release.
# Python is the project's virtual environment (.venv, made by scripts/setup-venv.sh).
PYTHON := $(CURDIR)/.venv/bin/python
BUILD := build
JOBS ?= 2
CMAKE_FLAGS := -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(PYTHON)

.PHONY: deps build demo test test-cpp test-python test-sanitize bench accuracy clean

deps:
	@bash scripts/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	$(BUILD)/bin/linattn demo

test: build
	$(MAKE) test-cpp test-python

test-cpp:
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-python:
	PYTHONPATH=$(BUILD)/python $(PYTHON) -m pytest -q python/tests

# C++ tests with AddressSanitizer + UndefinedBehaviorSanitizer in their own build folder.
test-sanitize: deps
	cmake -S . -B build-sanitize -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLINATTN_SANITIZE=ON \
	  -DPython_EXECUTABLE=$(PYTHON) \
	  -DLINATTN_PYTHON=OFF -DLINATTN_CLI=OFF
	cmake --build build-sanitize -j $(JOBS)
	cd build-sanitize && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

# The full sweep against PyTorch, with CSV and plots in out/bench (installs python3-torch and
# python3-matplotlib from Debian first; the program runs its Python helpers with that python3).
bench:
	LINATTN_WITH_BENCH_DEPS=1 bash scripts/install-deps.sh
	$(MAKE) build
	LINATTN_PYTHON=/usr/bin/python3 $(BUILD)/bin/linattn bench --plots out/bench

# The accuracy studies of docs/accuracy.md: CSV and plots in out/accuracy.
accuracy:
	LINATTN_WITH_BENCH_DEPS=1 bash scripts/install-deps.sh
	$(MAKE) build
	LINATTN_PYTHON=/usr/bin/python3 $(BUILD)/bin/linattn accuracy --out out/accuracy

clean:
	rm -rf $(BUILD) build-sanitize
