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
# every test, stops both. Fails when any test fails or a part ran none.
# As root, the tests run as an ordinary user, $(TEST_USER) (created if missing, registered
# in accounting; the cluster's fault controls alone go through sudo): root is Slurm's super
# user and would skip the permission checks users meet.
# Two lanes of pytest run side by side, one per core: the tests without a cluster in the
# foreground (the few whose timing suffers most under load, marked `last` by
# tests/conftest.py, after the others); beside them, the tests against 22.05, then the
# slow end-to-end tests without a cluster marked `lane2` (they mostly wait on the clock),
# so that the lanes end at about the same time. The suite is CPU-bound: a third lane of
# such tests only made every test slower and the timing-sensitive ones fail. A third
# pytest runs beside them all the same, of tests that mostly sleep: those against
# $(SECOND_SLURM) (shell jobs that wait on Slurm's own delays: a requeue's, MinJobAge, a
# wall limit), then the few without a cluster marked `lane3` (a wall limit, a timeout, the
# daemon's back-off). The other lanes' output follows. The lanes share nothing a test relies
# on: rendezvous ports are bound and published by the launchers (none comes from a job
# id), job ids differ (the clusters' from FirstJobId 20001, the mock's from a random
# offset), and each pytest without a cluster keeps the memory tier in a folder of its own
# (node names are alike, and a lost node's memory is wiped by name). The package's
# bytecode is compiled once first: the ordinary user may not write it, and each of the
# suite's thousands of processes would compile it again.
TEST_USER ?= ftslurm-test
PYTEST_RUN = PYTHONDONTWRITEBYTECODE=1 FTSLURM_SLURM_VERSIONS=22.05,$(SECOND_SLURM) \
	$$as_user $(PY) -m pytest -p no:cacheprovider $(PYTEST_ARGS)

test: install lint
	@set -o pipefail; \
	$(CLUSTER) up || exit 1; \
	$(CLUSTER2) up || { $(CLUSTER) destroy; exit 1; }; \
	sum1=$$(mktemp); sum2=$$(mktemp); sum3=$$(mktemp); sum4=$$(mktemp); sum5=$$(mktemp); \
	sum6=$$(mktemp); log6=$$(mktemp); \
	log2=$$(mktemp); log3=$$(mktemp); log4=$$(mktemp); rcs3=$$(mktemp); rcs4=$$(mktemp); \
	mem=$$(mktemp -d /dev/shm/ftslurm-tests.XXXXXX 2>/dev/null || mktemp -d); \
	mem4=$$(mktemp -d /dev/shm/ftslurm-tests.XXXXXX 2>/dev/null || mktemp -d); \
	mem6=$$(mktemp -d /dev/shm/ftslurm-tests.XXXXXX 2>/dev/null || mktemp -d); \
	rc1=0; rc2=0; rc3=0; rc4=0; rc5=0; rc6=0; as_user=""; \
	if [ "$$(id -u)" = 0 ]; then \
		{ $(CLUSTER) add-user $(TEST_USER) && $(CLUSTER2) add-user $(TEST_USER); } || \
			{ $(CLUSTER2) destroy; $(CLUSTER) destroy; exit 1; }; \
		chown $(TEST_USER) $$sum1 $$sum2 $$sum3 $$sum4 $$sum5 $$sum6 $$mem $$mem4 $$mem6; \
		as_user="runuser -u $(TEST_USER) --"; \
	fi; \
	$(PY) -m compileall -q ftslurm tests examples benchmarks >/dev/null || true; \
	{ r3=0; r6=0; FTSLURM_TEST_SUMMARY=$$sum3 $(PYTEST_RUN) -m slurm_2411 >$$log3 2>&1 || r3=$$?; \
	  FTSLURM_TEST_SUMMARY=$$sum6 FTSLURM_MEMORY_DIR=$$mem6 $(PYTEST_RUN) \
		-m "not slurm and lane3" >$$log6 2>&1 || r6=$$?; echo "$$r3 $$r6" >$$rcs4; } & p4=$$!; \
	{ r2=0; r4=0; \
	  FTSLURM_TEST_SUMMARY=$$sum2 $(PYTEST_RUN) -m "slurm and not slurm_2411" >$$log2 2>&1 || r2=$$?; \
	  FTSLURM_TEST_SUMMARY=$$sum4 FTSLURM_MEMORY_DIR=$$mem4 $(PYTEST_RUN) \
		-m "not slurm and lane2" >$$log4 2>&1 || r4=$$?; echo "$$r2 $$r4" >$$rcs3; } & p3=$$!; \
	FTSLURM_TEST_SUMMARY=$$sum1 FTSLURM_MEMORY_DIR=$$mem $(PYTEST_RUN) \
		-m "not slurm and not lane2 and not lane3 and not last" || rc1=$$?; \
	FTSLURM_TEST_SUMMARY=$$sum5 FTSLURM_MEMORY_DIR=$$mem $(PYTEST_RUN) \
		-m "not slurm and last" || rc5=$$?; \
	wait $$p3; read -r rc2 rc4 <$$rcs3 || { rc2=1; rc4=1; }; \
	wait $$p4; read -r rc3 rc6 <$$rcs4 || { rc3=1; rc6=1; }; \
	echo "=== the tests against Slurm 22.05 (run beside the others) ==="; cat $$log2; \
	echo "=== the tests against Slurm $(SECOND_SLURM) (beside those against 22.05) ==="; cat $$log3; \
	echo "=== the slow end-to-end tests without a cluster (lane2: after those against 22.05) ==="; \
	cat $$log4; \
	echo "=== the tests without a cluster that mostly sleep (lane3: after those against $(SECOND_SLURM)) ==="; \
	cat $$log6; \
	if [ $$rc2 -ne 0 ] || [ $$rc3 -ne 0 ]; then \
		first=$${FTSLURM_LOCAL_CLUSTER_DIR:-/tmp/ftslurm-localcluster}; \
		for ctld in $$first/log/slurmctld.log $$first-$(SECOND_SLURM)/log/slurmctld.log; do \
			echo "=== the last lines of $$ctld ==="; tail -n 60 $$ctld 2>/dev/null; done; fi; \
	$(CLUSTER2) destroy || true; \
	$(CLUSTER) destroy || true; \
	rm -rf $$mem $$mem4 $$mem6; \
	echo "pytest exit codes: without a cluster $$rc1 (lane2: $$rc4, lane3: $$rc6, last: $$rc5), Slurm 22.05 $$rc2," \
		"Slurm $(SECOND_SLURM) $$rc3"; \
	for rc in $$rc1 $$rc2 $$rc3 $$rc4 $$rc5 $$rc6; do \
		if [ $$rc -eq 5 ]; then echo "Error: a pytest run collected no tests"; exit 1; fi; done; \
	$(PY) -c "import json,sys; s1, s2, s3, s4, s5, s6 = (json.load(open(p)) for p in sys.argv[1:]); \
	line=lambda s, p: f\"{s[p+'_passed']} passed, {s[p+'_failed']} failed, {s[p+'_skipped']} skipped\"; \
	print(f\"without a cluster: {s1['passed'] + s4['passed'] + s5['passed'] + s6['passed']} passed ({s4['passed']} of them in lane2, {s6['passed']} in lane3, {s5['passed']} last); real Slurm cluster 22.05: {line(s2, 'slurm')}; Slurm $(SECOND_SLURM): {line(s3, 'slurm_2411')}\"); \
	runs = (s1, s2, s3, s4, s5, s6); users = sorted({s['user'] for s in runs}); \
	print(f\"all {sum(s['passed'] for s in runs)} passed tests ran as {', '.join(users)}\" + ('' if all(s['unprivileged'] for s in runs) else ' (root among them)')); \
	users_ok = not '$$as_user' or all(s['unprivileged'] for s in runs); \
	print('' if users_ok else 'Error: a run meant for $(TEST_USER) ran as root'); \
	no_cluster_ok = all(s['passed'] > 0 and not s['slurm_passed'] + s['slurm_2411_passed'] for s in (s1, s4, s5, s6)); \
	sys.exit(0 if users_ok and no_cluster_ok and s2['slurm_passed'] > 0 and not s2['slurm_failed'] and s3['slurm_2411_passed'] > 0 and not s3['slurm_2411_failed'] else 1)" \
		$$sum1 $$sum2 $$sum3 $$sum4 $$sum5 $$sum6 || exit 1; \
	[ $$rc1 -eq 0 ] && [ $$rc2 -eq 0 ] && [ $$rc3 -eq 0 ] && [ $$rc4 -eq 0 ] && [ $$rc5 -eq 0 ] && [ $$rc6 -eq 0 ]

lint: install
	$(VENV)/bin/ruff check ftslurm tests benchmarks examples
	$(VENV)/bin/ruff format --check ftslurm tests benchmarks examples

# Tests that need no cluster (one pytest: about 85 minutes on 2 cores, measured in parts).
unit: install
	$(PY) -m pytest -m "not slurm" $(PYTEST_ARGS)

# The fast set: no cluster, no end-to-end scenarios marked slow (about 25 minutes on 2 cores).
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
	$(PY) benchmarks/health_check.py
	$(PY) benchmarks/live_recovery.py
	$(PY) benchmarks/checkpoint_throughput.py
	$(CLUSTER) up
	$(PY) benchmarks/query_scaling.py
	$(PY) benchmarks/slurm_recovery.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
