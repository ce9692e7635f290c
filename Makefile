# Two commands are the whole set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# On a CPU machine this pins the local CPU build; a GPU/NPU user with torch already in the
# venv keeps theirs (torch is installed only when `import torch` fails).
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.ldt-installed
# Test files run two at a time (pytest-xdist), each file whole on one worker: a module's
# worlds and fixtures stay together, and a one-process test fills the core a world leaves
# idle. TEST_WORKERS=0 runs them one after another in pytest's process (pdb, -s).
TEST_WORKERS ?= 2

.PHONY: demo test bench install clean device-check device-wheels

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ldt-train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 tests $(ARGS)  # the slowest 30: the suite must stay under 20 min

bench: $(STAMP)
	$(PY) -m bench.run_all $(ARGS)

# One NVIDIA GPU: every check of docs/device_check.md in under 9 minutes, results in OUT
# (a machine without a GPU: one line, exit 0). device-wheels: what that machine lacks.
OUT ?= outputs/device-check
device-check:
	bash tools/device_check.sh $(OUT)

device-wheels: $(STAMP)
	PY=$(PY) bash tools/device_wheels.sh .device-wheels

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
