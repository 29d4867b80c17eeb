# node-agent — developer entry points.
#   make test   set up everything (Debian packages, venv, test control plane), then lint, type-check, test
#   make demo   guided end-to-end tour of the agent on a throwaway node
# Both run as root on a Debian machine; see README.md.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
APT_PACKAGES := gcc pkg-config libsystemd-dev libzstd-dev zstd dbus util-linux e2fsprogs iproute2 openssl curl shellcheck containerd docker-registry \
  mmdebstrap arch-test gpg qemu-user-static binfmt-support gcc-aarch64-linux-gnu libc6-dev-arm64-cross binutils \
  qemu-system-x86 dosfstools mtools socat iptables containernetworking-plugins
CONTROLPLANE_STAMP := $(VENV)/.controlplane
PYTEST_ARGS ?=
# Everything the tests build or write stays in this cache, never in the host's /tmp.
export NODE_AGENT_TEST_CACHE ?= $(HOME)/.cache/node-agent-test
export TMPDIR := $(NODE_AGENT_TEST_CACHE)/tmp
$(shell mkdir -p $(TMPDIR))

.PHONY: help prepare deps venv controlplane kubelet kubelet-amd64 kubelet-arm64 vm-image gardener gardener-all compat promtool monitoring artifact image lint typecheck unit test fuzz demo clean

help:
	@echo "make test   - set up and run ruff, mypy (strict) and the whole pytest suite"
	@echo "make demo   - run the agent's real job end to end on a throwaway node"
	@echo "make compat - every Gardener release of tests/testbed/gardener/releases: config oracle,"
	@echo "              provision from Gardener's user data, differential twin"
	@echo "make artifact - build dist/node-agent-<version>-linux-{amd64,arm64}.tar.gz (+ .sha256; cached)"
	@echo "make image  - build dist/node-agent-<version>-image.oci.tar (amd64+arm64 index; cached)"
	@echo "make monitoring - promtool check + unit tests of the alert and recording rules"
	@echo "make fuzz   - the fuzzing harness's long run: FUZZ_EXAMPLES (2000) examples per target,"
	@echo "              random (seed printed; NODE_AGENT_FUZZ_SEED=<seed> replays a run)"
	@echo "make lint | typecheck | unit | clean"

deps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(BIN)/python: | deps
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python deps
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# The bed's Go builds run niced: each is two compilers wide and fills whatever the other jobs of
# `make prepare` leave, while the one-process jobs (PyInstaller under emulation for the arm64
# artifact, the VM image) would otherwise get a fraction of a core and finish last.
GO_BUILD := nice -n 10 sh

# The control plane, then the real kubelet at its Kubernetes version, from the same module
# (tests/testbed/controlplane): after the control plane, that kubelet compiles little of its own.
CONTROLPLANE_KUBELET := kubelet-$(shell sed -n 's/^\tk8s.io\/kubernetes v//p' tests/testbed/controlplane/go.mod)
controlplane: deps
	@$(GO_BUILD) tests/testbed/build-controlplane.sh > /dev/null
	@$(GO_BUILD) tests/testbed/build-controlplane.sh $(CONTROLPLANE_KUBELET) > /dev/null

# The worker machine image the VM tests boot (Debian's packages, cached by its build script).
vm-image: deps
	@sh tests/testbed/vm/build-image.sh > /dev/null

# The real kubelets, at the Kubernetes versions of the Gardener shapes their tests provision:
# the control plane's (above) and those of tests/testbed/kubelet-<version>/; that of the k8s-1.34
# shape also for linux/arm64 (the emulated arm64 node). The amd64 ones one after the other, newest
# first: they share their third-party dependencies, which the first build leaves in Go's build
# cache for the next (builds side by side would each compile them). The arm64 build shares
# nothing with them: a job of its own.
KUBELETS := $(shell cd tests/testbed && ls -d kubelet-* | sort -rV)
ARM64_KUBELETS := kubelet-1.34.0
kubelet: controlplane kubelet-amd64 kubelet-arm64
kubelet-amd64: deps
	@for module in $(KUBELETS); do \
	  $(GO_BUILD) tests/testbed/build-controlplane.sh "$$module" > /dev/null || exit 1; done
kubelet-arm64: deps
	@for module in $(ARM64_KUBELETS); do \
	  $(GO_BUILD) tests/testbed/build-controlplane.sh "$$module" arm64 > /dev/null || exit 1; done

# Gardener's own generator and upstream gardener-node-agent, built per Gardener release
# (tests/testbed/gardener/releases; cached like the control plane): `make test` needs the oldest
# and the newest, `make compat` every release.
GARDENER_BUILD := $(GO_BUILD) tests/testbed/build-gardener.sh
gardener: deps
	@$(GARDENER_BUILD) > /dev/null
	@$(GARDENER_BUILD) "$$($(GARDENER_BUILD) --list | head -n 1)" > /dev/null

gardener-all: deps
	@for release in $$($(GARDENER_BUILD) --list); do $(GARDENER_BUILD) "$$release" > /dev/null; done

# promtool, built from Prometheus' Go module like the control plane (cached by version).
promtool: deps
	@$(GO_BUILD) tests/testbed/build-promtool.sh > /dev/null

# The monitoring mixin: the rules are valid, every alert and recording rule passes its tests.
monitoring: promtool
	@promtool=$$(sh tests/testbed/build-promtool.sh); \
	"$$promtool" check rules monitoring/rules.yaml; \
	"$$promtool" test rules monitoring/tests/*.yaml

lint: venv
	$(BIN)/ruff check node_agent tests bench packaging
	$(BIN)/ruff format --check node_agent tests bench packaging
	shellcheck -x init/node-agent-init.sh packaging/build.sh packaging/rootfs.sh tests/testbed/build-promtool.sh \
	  tests/testbed/build-gardener.sh tests/testbed/build-controlplane.sh tests/testbed/go-env.sh tests/testbed/vm/build-image.sh

typecheck: venv
	$(BIN)/mypy node_agent tests bench

unit: venv
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

# The fuzzing harness (tests/fuzz) on its long budget: every target gets FUZZ_EXAMPLES random
# examples instead of the short, derandomized budget of `make test`. The seed is printed first;
# NODE_AGENT_FUZZ_SEED=<seed> replays a run. No Hypothesis database is read or written.
FUZZ_EXAMPLES ?= 2000
fuzz: venv
	@seed="$${NODE_AGENT_FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"; \
	echo "fuzz: $(FUZZ_EXAMPLES) examples per target, NODE_AGENT_FUZZ_SEED=$$seed"; \
	NODE_AGENT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) NODE_AGENT_FUZZ_SEED=$$seed \
	  $(BIN)/pytest tests/fuzz --timeout=0 --hypothesis-show-statistics $(PYTEST_ARGS)

# The self-contained artifact for linux/amd64 and linux/arm64 (packaging/build.sh; the other
# architecture than this machine's is built in an emulated Debian root, packaging/rootfs.sh; each
# reused from the cache while its sources are unchanged). The integration tests install them on
# throwaway nodes.
artifact: artifact-amd64 artifact-arm64
artifact-%: deps venv
	NODE_AGENT_ARCH=$* PYTHON=$(BIN)/python sh packaging/build.sh

# The OCI image layout, an index of linux/amd64 and linux/arm64 with the agent as one executable
# each (packaging/image.py; no container daemon; reused from the cache while the artifacts and
# the launcher are unchanged).
image: artifact
	$(BIN)/python packaging/image.py

# What the suite needs, built side by side (make -j): the Go builds of the bed (the control plane,
# the amd64 kubelets, the arm64 kubelet, the Gardener releases: four jobs), the emulated arm64
# artifact and the checks fill the cores between them (while one job downloads, links or runs on
# one core, the others compile); each is cached on its own. The venv is made first, on its own;
# then the arm64 artifact starts first: its PyInstaller runs under emulation on one core.
PREPARE := artifact-arm64 controlplane kubelet-amd64 vm-image gardener kubelet-arm64 artifact-amd64 \
  image lint typecheck monitoring
PREPARE_JOBS ?= 4
prepare:
	@$(MAKE) --no-print-directory deps venv
	@$(MAKE) --no-print-directory -j$(PREPARE_JOBS) $(PREPARE)

# The suite's files run side by side on TEST_JOBS workers (pytest-xdist; a file's tests stay
# together on one worker, each worker has its own control plane and registry): most tests wait
# on timers and processes, not on the cores. TEST_JOBS=0 runs them one after the other.
# --no-loadscope-reorder: the files in the order tests/conftest.py gives them (the slow ones
# first), not by their number of tests (which would leave the one-test VM and twin to the end).
TEST_JOBS ?= 3
test: prepare
	rm -rf "$(TMPDIR)"/pytest-of-*
	$(BIN)/pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# Every Gardener release the bed serves (tests/testbed/gardener/releases), end to end: the
# config oracle, the provision from Gardener's user data and the differential twin, each once
# per release (`make test` runs the oldest and the newest, the twin on the newest only).
COMPAT_TESTS := tests/integration/test_config_oracle.py tests/integration/test_gardener_provision.py \
  tests/integration/test_twin.py
# The tests run one by one across TEST_JOBS workers (--dist load: a release's twin beside the
# next one's); COMPAT_RELEASES picks some releases (comma-separated) instead of all.
COMPAT_RELEASES ?= all
compat: deps venv controlplane kubelet gardener-all artifact image
	rm -rf "$(TMPDIR)"/pytest-of-*
	NODE_AGENT_GARDENER_RELEASES=$(COMPAT_RELEASES) $(BIN)/pytest -n $(TEST_JOBS) --dist load \
	  $(COMPAT_TESTS) $(PYTEST_ARGS)

demo: deps venv controlplane
	$(BIN)/python -m tests.demo

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis build dist *.egg-info
