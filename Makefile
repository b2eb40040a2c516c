# `make demo` / `make test` create .venv on first use and reuse it afterwards.
VENV    := .venv
PYTHON  := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# tests/test_app.py drives Debian's Chromium through Playwright (Playwright's own browser download is not used).
CHROMIUM := /usr/bin/chromium
SUDO    := $(if $(filter 0,$(shell id -u)),,sudo)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test benchmark

install: $(STAMP) $(CHROMIUM)

$(STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	# Pinned CPU build first (a local file here); an unpinned torch pulls a multi-GB CUDA build.
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Only when missing: apt-get is slow and needs root.
$(CHROMIUM):
	$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
	  || { echo "make: the browser tests need Chromium at $(CHROMIUM); install Debian's chromium package (apt-get install chromium)" >&2; exit 1; }

demo: $(STAMP)
	$(PYTHON) scripts/demo.py

test: $(STAMP) $(CHROMIUM)
	$(PYTHON) -m pytest -q

benchmark: $(STAMP)
	$(PYTHON) scripts/benchmark.py
