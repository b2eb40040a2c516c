# `make demo` / `make test` create .venv on first use and reuse it afterwards.
VENV    := .venv
PYTHON  := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test benchmark

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	# Pinned CPU build first (a local file here); an unpinned torch pulls a multi-GB CUDA build.
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PYTHON) scripts/demo.py

test: $(STAMP)
	$(PYTHON) -m pytest -q

benchmark: $(STAMP)
	$(PYTHON) scripts/benchmark.py
