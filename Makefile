# ftslurm — the two commands are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build is enough for tests and demos; override for a GPU build.
TORCH_SPEC ?= torch==2.13.0
CLUSTER := $(PY) -m ftslurm.localcluster
# The second Slurm release `make test` runs the conformance and CLI live tests on (a chroot
# of a Debian trixie root filesystem, built once into /var/cache/ftslurm; ~40 s).
SECOND_SLURM := 24.11
CLUSTER2 := $(CLUSTER) --version $(SECOND_SLURM)

.PHONY: install demo demo-slurm test unit fast lint slurm-up slurm-down slurm-status slurm-destroy \
	slurm2-up slurm2-down slurm2-destroy bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "Error: $(PYTHON) not found"; exit 1; }
	@# Debian ships venv's pip bootstrap separately (python3-venv).
	@$(PYTHON) -c "import ensurepip" 2>/dev/null || { command -v apt-get >/dev/null && \
		[ "$$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv; } || \
		{ echo "Error: $(PYTHON) cannot create a venv; install python3-venv"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

# A real 2-rank PyTorch run on the mock scheduler survives an injected node failure and
# preemption, and ends with the same parameters as an uninterrupted run. No Slurm needed.
demo: install
	$(PY) examples/demo_mock.py

# The same idea on the real local 4-node Slurm cluster (installs Slurm's packages if needed).
demo-slurm: install
	$(CLUSTER) up
	$(PY) examples/demo_node_failure.py

# Everything: installs, starts both local Slurm clusters (22.05 and $(SECOND_SLURM)), runs
# every test, stops both. Fails when the tests against either release fail or none ran.
# As root, the main run is an ordinary user's, $(TEST_USER) (created if missing, registered
# in accounting; the cluster's fault controls alone go through sudo): root is Slurm's super
# user and would skip the permission checks users meet. The tests against $(SECOND_SLURM)
# (its own cluster, mostly waiting on Slurm), also as that user, run in a second pytest
# beside the main one; their output follows the main run's.
TEST_USER ?= ftslurm-test

test: install lint
	@set -o pipefail; \
	$(CLUSTER) up || exit 1; \
	$(CLUSTER2) up || { $(CLUSTER) destroy; exit 1; }; \
	summary=$$(mktemp); summary2=$$(mktemp); log2=$$(mktemp); rc=0; rc2=0; as_user=""; \
	if [ "$$(id -u)" = 0 ]; then \
		{ $(CLUSTER) add-user $(TEST_USER) && $(CLUSTER2) add-user $(TEST_USER); } || \
			{ $(CLUSTER2) destroy; $(CLUSTER) destroy; exit 1; }; \
		chown $(TEST_USER) $$summary $$summary2; as_user="runuser -u $(TEST_USER) --"; \
	fi; \
	FTSLURM_SLURM_VERSIONS=22.05,$(SECOND_SLURM) FTSLURM_TEST_SUMMARY=$$summary2 \
		PYTHONDONTWRITEBYTECODE=1 $$as_user $(PY) -m pytest -p no:cacheprovider \
		-m slurm_2411 $(PYTEST_ARGS) >$$log2 2>&1 & second=$$!; \
	FTSLURM_SLURM_VERSIONS=22.05,$(SECOND_SLURM) FTSLURM_TEST_SUMMARY=$$summary \
		PYTHONDONTWRITEBYTECODE=1 $$as_user $(PY) -m pytest -p no:cacheprovider \
		-m "not slurm_2411" $(PYTEST_ARGS) || rc=$$?; \
	wait $$second || rc2=$$?; \
	echo "=== the tests against Slurm $(SECOND_SLURM) (run beside the others) ==="; cat $$log2; \
	if [ $$rc -ne 0 ] || [ $$rc2 -ne 0 ]; then \
		first=$${FTSLURM_LOCAL_CLUSTER_DIR:-/tmp/ftslurm-localcluster}; \
		for ctld in $$first/log/slurmctld.log $$first-$(SECOND_SLURM)/log/slurmctld.log; do \
			echo "=== the last lines of $$ctld ==="; tail -n 60 $$ctld 2>/dev/null; done; fi; \
	$(CLUSTER2) destroy || true; \
	$(CLUSTER) destroy || true; \
	if [ $$rc -eq 5 ] || [ $$rc2 -eq 5 ]; then echo "Error: pytest collected no tests"; exit 1; fi; \
	[ $$rc2 -eq 0 ] || rc=1; \
	$(PY) -c "import json,sys; s=json.load(open('$$summary')); s2=json.load(open('$$summary2')); \
	line=lambda s, p: f\"{s[p+'_passed']} passed, {s[p+'_failed']} failed, {s[p+'_skipped']} skipped\"; \
	who=lambda s: f\"as {s['user']}, {'an unprivileged user' if s['unprivileged'] else 'root'}\"; \
	print(f\"real Slurm cluster 22.05: {line(s, 'slurm')}; Slurm $(SECOND_SLURM): {line(s2, 'slurm_2411')}\"); \
	print(f\"main run {who(s)}: {s['passed']} tests passed ({s['slurm_passed']} on a real cluster); Slurm $(SECOND_SLURM) run {who(s2)}: {s2['passed']} passed\"); \
	users_ok=not '$$as_user' or (s['unprivileged'] and s2['unprivileged']); \
	print('' if users_ok else 'Error: a run meant for $(TEST_USER) ran as root'); \
	sys.exit(0 if users_ok and s['slurm_passed'] > 0 and not s['slurm_failed'] and s2['slurm_2411_passed'] > 0 and not s2['slurm_2411_failed'] else 1)" || rc=1; \
	exit $$rc

lint: install
	$(VENV)/bin/ruff check ftslurm tests benchmarks examples

# Tests that need no cluster (about 12 minutes on 2 cores).
unit: install
	$(PY) -m pytest -m "not slurm" $(PYTEST_ARGS)

# The fast set: no cluster, no end-to-end scenarios marked slow (a few minutes).
fast: install
	$(PY) -m pytest -m "not slurm and not slow" $(PYTEST_ARGS)

slurm-up: install
	$(CLUSTER) up

slurm-down: install
	$(CLUSTER) down

slurm-status: install
	$(CLUSTER) status

slurm-destroy: install
	$(CLUSTER) destroy

# The second release's cluster by hand (beside the first: its own folder, ports, munge).
slurm2-up: install
	$(CLUSTER2) up

slurm2-down: install
	$(CLUSTER2) down

slurm2-destroy: install
	$(CLUSTER2) destroy

# Every benchmark; results and what they mean: docs/performance.md.
bench: install
	$(PY) benchmarks/goodput.py --plot goodput.png
	$(PY) benchmarks/virtual_campaign.py
	$(PY) benchmarks/daemon_scale.py
	$(PY) benchmarks/agent_overhead.py
	$(PY) benchmarks/checkpoint_throughput.py
	$(CLUSTER) up
	$(PY) benchmarks/query_scaling.py
	$(PY) benchmarks/slurm_recovery.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
