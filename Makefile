# elasticd developer targets. `make test` is what CI runs (via .ci/run).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The test, lint and benchmark tools (the `test` extra: pytest, moto, the HF and Lightning
# integrations' libraries) on top: `make demo` does not wait for them.
TEST_STAMP := $(VENV)/.installed-test
PYTEST_ARGS ?=
# `make test` runs the suite on this many pytest-xdist workers (0: in one process). Two on
# two cores: an agent test spends much of its wall time waiting on its processes, so two
# side by side took 19 min where one process took 28 (idle). The two hazards that kept the
# default at 0 are fixed: the embedded etcd picks ports below the ephemeral range and
# starts again on fresh ones if its port was taken anyway, and the live replay whose ledger
# figure moved with a neighbour's load runs under `make soak`.
PYTEST_WORKERS ?= 2

.PHONY: venv test lint unit integration chaos soak demo bench clean compat compat-reconfigure wheel

venv: $(STAMP)

# One line per phase: the first `make demo` spends most of its time here, not in the demo.
$(STAMP): pyproject.toml
	@echo "== creating the virtualenv $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "== upgrading pip"
	$(PY) -m pip install -q --upgrade pip
	@echo "== installing torch 2.13.0, CPU build (~200 MB, once)"
	# A CPU build of torch from the local wheel cache; users bring their own CUDA torch.
	$(PY) -m pip install -q torch==2.13.0
	@echo "== installing elasticd (editable) with its plot tools"
	# torch==2.13.0 is repeated here on purpose: with an extra (`.[plot]`), pip 26's resolver
	# otherwise backtracks to the newest torch the range allows (2.14.1, a CUDA build of
	# several GB) even though 2.13.0 is installed and satisfies it.
	$(PY) -m pip install -q -e '.[plot]' torch==2.13.0
	touch $(STAMP)
	@echo "== $(VENV) ready"

$(TEST_STAMP): $(STAMP) pyproject.toml
	@echo "== installing the test tools (pytest, moto, ruff, mypy, transformers, lightning)"
	$(PY) -m pip install -q -e '.[test]' torch==2.13.0
	touch $(TEST_STAMP)

# elasticd is not on PyPI: this builds the wheel to install elsewhere
# (pip install dist/elasticd-*.whl, plus '[s3]'/'[plot]' extras). Any Python 3.10+ with
# pip; the build backend (setuptools, wheel) comes from the index unless
# WHEEL_ARGS=--no-build-isolation uses the ones installed. build/ is removed first: a
# stale build/lib would ship modules deleted since.
DIST ?= dist
WHEEL_ARGS ?=
wheel:
	rm -rf build elasticd.egg-info
	$(PYTHON) -m pip wheel --no-deps -q $(WHEEL_ARGS) -w $(DIST) .
	rm -rf build elasticd.egg-info
	@ls $(DIST)/elasticd-*.whl

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check elasticd tests benchmarks examples
	$(VENV)/bin/mypy

# The suite CI runs: every test but the soak-marked ones (`make soak`); benchmarks are
# `make bench`. Behaviour a soak run checks is also pinned by a test here.
# With bytecode caches: every agent, worker and standby the suite starts imports elasticd,
# and each pytest worker rewrites every test module; where PYTHONDONTWRITEBYTECODE is set
# (CI images often set it) each did so from source (collection: 15.5 CPU-s, cached 8).
test: $(TEST_STAMP) lint
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q --durations=20 -n $(PYTEST_WORKERS) --dist worksteal -m "not soak" tests $(PYTEST_ARGS)

unit: $(TEST_STAMP)
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

integration: $(TEST_STAMP)
	$(PY) -m pytest -q tests/integration $(PYTEST_ARGS)

chaos: $(TEST_STAMP)
	$(PY) -m pytest -q tests/chaos $(PYTEST_ARGS)

# Long and randomized runs: the soak-marked tests, and the chaos tests at their long sizes.
soak: $(TEST_STAMP)
	ELASTICD_SOAK=1 $(PY) -m pytest -q tests/chaos $(PYTEST_ARGS)
	ELASTICD_SOAK=1 $(PY) -m pytest -q -m soak tests/integration $(PYTEST_ARGS)

demo: $(STAMP)
	@echo "== running the demo (~2-3 min): etcd, two nodes, a kill, a rejoin, a picture"
	$(PY) examples/demo.py

bench: $(TEST_STAMP)
	$(PY) benchmarks/recovery.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/scale.py
	$(PY) benchmarks/checkpoint.py

# A newer torch than make test's, in a venv of its own: unit tests and the agent
# integration tests. Not part of `make test` (a multi-GB torch install). 2.14.1 is the
# newest this machine's pip serves; pyproject admits 2.15 (COMPAT_TORCH=2.15.0 elsewhere).
COMPAT_VENV  ?= .venv-compat
COMPAT_TORCH ?= 2.14.1
COMPAT_STAMP := $(COMPAT_VENV)/.installed-$(COMPAT_TORCH)

$(COMPAT_STAMP): pyproject.toml
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install -q torch==$(COMPAT_TORCH)
	$(COMPAT_VENV)/bin/python -m pip install -q -e '.[test]' torch==$(COMPAT_TORCH)
	touch $(COMPAT_STAMP)

compat: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -c 'import torch; print("compat: torch", torch.__version__)'
	$(COMPAT_VENV)/bin/python -m pytest -q tests/unit tests/integration/agent $(PYTEST_ARGS)

# The reconfigure lifecycle (torch 2.14+: c10d _reconfigure, the default there) on every CI
# run (.ci/run): the lifecycle's unit tests, the 16-re-formation leak test (its soak size;
# `make test` runs 8) and the HSDP live kill-and-join (a mesh's subgroups re-made over the
# reconfigured group), minutes.
compat-reconfigure: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -c 'import torch; print("compat: torch", torch.__version__)'
	$(COMPAT_VENV)/bin/python -m pytest -q tests/unit/test_process_group.py \
		"tests/integration/agent/test_group_lifecycle.py::test_live_reformations_leave_threads_and_fds_flat[8]" \
		"tests/integration/agent/test_fsdp_elastic.py::test_hsdp_live_kill_and_join_keeps_the_survivors_and_their_shards" \
		$(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
