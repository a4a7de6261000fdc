# Murmur: `make simulate` trains a 4-peer swarm on loopback; `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PEERS ?= 4
DURATION ?= 60

.PHONY: install browser simulate test test-fast lint format clean

install: $(STAMP)

# torch goes first, pinned: the CPU wheel of 2.13.0 is on this machine's disk, whereas an unpinned
# torch with none installed would pull a CUDA build of several GB. setup.cfg then asks for a range
# that 2.13.0 satisfies, so installing the project adds nothing to torch.
$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	echo "torch==2.13.0" > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e '.[test]'
	touch $(STAMP)

# the dashboard's browser test runs Debian's Chromium and ChromeDriver (apt, as root or through sudo)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium chromium-driver >/dev/null; fi

simulate: install
	$(VENV)/bin/murmur simulate --peers $(PEERS) --duration $(DURATION) --report report.json

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the tests that may share the two cores run two at a time (pytest-xdist); those marked slow but not concurrent
# (real peers training against round deadlines) then run one by one, as they would alone on a volunteer's machine
test: lint browser
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal -m "not slow or concurrent"
	$(PY) -m pytest -q -p no:cacheprovider -m "slow and not concurrent"

test-fast: install
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow"

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) runs report.json *.egg-info
