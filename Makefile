# The front door. `make install` builds .venv; `make test` runs everything, Docker included.
# A system Python is preferred: as root, local sandboxes run as unprivileged uids that must be
# able to read the interpreter (pyenv's under /root is out of their reach).
PYTHON ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# E2B's v1 SDK and its MCP server, which pins it (tests/clients/e2b_sdk/test_sdk_v1.py): a venv
# of their own, since ours has the v2 SDK.
E2B_V1 := .venv-e2b-v1
E2B_V1_STAMP := $(E2B_V1)/.installed

.PHONY: install pyodide microvm-kernel test test-cluster test-gvisor test-microvm unit lint format demo image engine serve bench bench-full clean

install: $(STAMP) $(E2B_V1_STAMP) pyodide microvm-kernel
# The wasm backend's Pyodide (docs/wasm.md): the pinned release from npm's registry, checked
# against its published integrity; nothing is fetched when it is there already.
pyodide: $(STAMP)
	@$(BIN)/python -m sandbox.backends.wasm.distribution >/dev/null

# The microvm backend's guest kernel (docs/microvm.md): Debian's cloud kernel package, fetched
# with apt and unpacked into the user's cache (never installed on this host). Where apt is not
# (another distribution), a warning; in CI, a failure.
microvm-kernel: $(STAMP)
	@$(BIN)/python -m sandbox.backends.microvm.guest_kernel >/dev/null || { \
		if [ -n "$$CI" ]; then exit 1; fi; \
		echo "warning: no guest kernel for the microvm backend (docs/microvm.md)" >&2; }

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[server,kernel,languages,dev]'
	touch $@

$(E2B_V1_STAMP):
	$(PYTHON) -m venv $(E2B_V1)
	$(E2B_V1)/bin/pip install -q 'e2b-code-interpreter>=1.5,<2' 'e2b-mcp-server>=0.1.1'
	touch $@

# Two test workers a core, at most four: a test mostly waits (a kernel starting, a sandbox's
# processes dying, a time limit running out), so one worker a core leaves the cores half idle; three on two cores (four showed load flakes).
# A file runs whole on one worker; the slowest files start first (tests/conftest.py), so
# xdist's own order (by test count) is turned off.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n * 2 < 3 ? n * 2 : 3 )))
XDIST := --numprocesses=$(TEST_WORKERS) --dist=loadfile --no-loadscope-reorder

# The Docker tests need an engine and the images: start and build them when we can. Where no
# engine can be had, the Docker tests skip on a developer's machine and fail in CI (CI=true).
# The three suites (main, cluster, gVisor) all run even when one fails; the end names those that
# failed.
test: install
	@if scripts/ensure-docker-engine.sh; then $(MAKE) --no-print-directory image; \
	else echo "warning: no Docker engine: the Docker tests cannot run" >&2; fi
	@failed=""; \
	$(BIN)/pytest $(XDIST) -m "not cluster and not microvm_full" || failed="$$failed main"; \
	$(MAKE) --no-print-directory test-cluster || failed="$$failed cluster"; \
	$(MAKE) --no-print-directory test-gvisor || failed="$$failed gvisor"; \
	if [ -n "$$failed" ]; then echo "make test: failed suites:$$failed" >&2; exit 1; fi; \
	echo "make test: the main, cluster and gVisor suites passed"

# Cluster mode (docs/cluster.md): real Ray clusters and redis-servers on 127.0.0.1. Each module
# starts a cluster of its own, so they run one after the other, never beside the suite above.
# Without Ray or redis-server they cannot run: a warning on a developer's machine, a failure in CI.
test-cluster: install
	@missing=""; \
	$(BIN)/python -c 'import ray, redis' 2>/dev/null || missing="the cluster extra (ray, redis)"; \
	command -v redis-server >/dev/null || missing="$${missing:+$$missing and }redis-server"; \
	if [ -z "$$missing" ]; then $(BIN)/pytest -m cluster tests/cluster; \
	elif [ -n "$$CI" ]; then \
		echo "error: $$missing missing: run scripts/install-system-packages.sh and make install" >&2; \
		exit 1; \
	else echo "warning: $$missing missing: the cluster tests cannot run" >&2; fi

# The Docker suite's security-bearing part again, every container under gVisor (docs/gvisor.md).
# Deselected: what looks for sandbox processes among the host's (under gVisor they are not
# host processes), and what gVisor does differently (docs/gvisor.md, "What differs").
GVISOR_TESTS := tests/sandbox/test_execution.py tests/sandbox/test_files.py \
	tests/sandbox/processes/test_processes.py tests/sandbox/test_isolation.py \
	tests/sandbox/kernel/test_rich_results.py tests/security/test_escape.py \
	tests/security/test_resource_abuse.py tests/security/test_process_abuse.py \
	tests/security/test_file_abuse.py tests/security/test_output_bounds.py \
	tests/security/test_interrupt_socket.py tests/security/test_memory_bounds.py \
	tests/orchestrator/host_tools/test_sandbox_tools.py \
	tests/orchestrator/service/test_processes_api.py tests/network/test_session_egress.py \
	tests/orchestrator/service/test_volumes_api.py
GVISOR_DIFFERS := \
	tests/sandbox/test_isolation.py::test_daemonized_child_does_not_outlive_the_session[docker] \
	tests/sandbox/test_isolation.py::test_daemonized_child_does_not_outlive_a_kernel_restart[docker] \
	tests/security/test_process_abuse.py::test_a_detached_daemon_dies_with_its_session[docker] \
	tests/sandbox/test_isolation.py::test_dangerous_system_calls_are_refused[docker] \
	tests/security/test_escape.py::test_no_device_or_kernel_interface_to_abuse[docker] \
	tests/security/test_process_abuse.py::test_a_command_is_confined_exactly_as_the_kernel[docker] \
	tests/security/test_process_abuse.py::test_a_terminal_is_the_processs_controlling_terminal[docker] \
	tests/security/test_process_abuse.py::test_a_memory_bomb_as_a_command_ends_typed_and_the_kernel_carries_on[docker] \
	tests/sandbox/processes/test_processes.py::test_a_fork_bomb_in_a_command_is_contained[docker] \
	tests/security/test_process_abuse.py::test_a_fork_bomb_leaves_the_bystander_and_the_kernel_working[docker] \
	tests/orchestrator/service/test_processes_api.py::test_a_terminal_client_that_does_not_read_misses_output_instead_of_queueing_it[docker]
test-gvisor: install
	@if docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"'; then \
		echo "the Docker tests again, under gVisor (runsc)"; \
		CIR_TEST_BACKENDS=docker CIR_DOCKER_RUNTIME=runsc $(BIN)/pytest $(XDIST) \
			$(GVISOR_TESTS) $(addprefix --deselect=,$(GVISOR_DIFFERS)); \
	elif [ -n "$$CI" ]; then \
		echo "error: the Docker engine has no runsc runtime: run scripts/ensure-docker-engine.sh" >&2; \
		exit 1; \
	else echo "warning: no runsc runtime: the gVisor tests cannot run" >&2; fi

# The microvm backend's whole set (docs/microvm.md): its own longer tests, and the suite's
# security-bearing part again with every sandbox a virtual machine. Under TCG (no KVM) a
# machine boots in seconds and computes ~5x slower: `make test` runs only its smoke set
# (tests/microvm/test_microvm_sandbox.py). Deselected: what looks for sandbox processes among
# the host's, and what a machine of its own does differently (docs/microvm.md).
MICROVM_TESTS := tests/microvm tests/sandbox/test_execution.py tests/sandbox/test_files.py \
	tests/sandbox/processes/test_processes.py tests/sandbox/test_isolation.py \
	tests/security/test_escape.py tests/security/test_resource_abuse.py \
	tests/security/test_process_abuse.py tests/security/test_file_abuse.py \
	tests/security/test_output_bounds.py
MICROVM_DIFFERS := \
	tests/sandbox/test_isolation.py::test_no_host_secrets_in_any_environment[microvm] \
	tests/sandbox/test_isolation.py::test_daemonized_child_does_not_outlive_the_session[microvm] \
	tests/sandbox/test_isolation.py::test_daemonized_child_does_not_outlive_a_kernel_restart[microvm] \
	tests/sandbox/test_isolation.py::test_sessions_cannot_see_each_other[microvm] \
	tests/sandbox/test_isolation.py::test_the_kernel_directory_cannot_be_tampered_with[microvm] \
	tests/sandbox/test_isolation.py::test_dangerous_system_calls_are_refused[microvm] \
	tests/security/test_process_abuse.py::test_a_command_is_confined_exactly_as_the_kernel[microvm] \
	tests/security/test_process_abuse.py::test_a_detached_daemon_dies_with_its_session[microvm]
test-microvm: install
	CIR_TEST_BACKENDS=microvm $(BIN)/pytest $(XDIST) $(MICROVM_TESTS) \
		$(addprefix --deselect=,$(MICROVM_DIFFERS))

# The fast tier: pure modules only (no bwrap, no Docker, no kernel, no server), in seconds. Such a
# test file lives beside the others of its module and says `pytestmark = pytest.mark.unit`.
unit: install
	$(BIN)/pytest -m unit -q

engine:
	scripts/ensure-docker-engine.sh

# Seconds when nothing changed: each image carries the hash of what it was built from.
image: install engine
	$(BIN)/code-interpreter image build

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The HTTP service on 127.0.0.1:8000 with the local backend and auth off: for one user only.
serve: install
	CODE_INTERPRETER_AUTH_DISABLED=true $(BIN)/code-interpreter serve --host 127.0.0.1 --port 8000

# Every goal's figure beside its baseline, sampled in turns (about 8 minutes on 2 cores);
# writes bench/results/latest.*. bench-full adds the long parts (about 45 minutes).
bench: install
	@scripts/ensure-docker-engine.sh && $(MAKE) --no-print-directory image || true
	$(BIN)/python -m bench.run

bench-full: install
	@scripts/ensure-docker-engine.sh && $(MAKE) --no-print-directory image || true
	$(BIN)/python -m bench.run --full

demo: install
	$(BIN)/code-interpreter run -f examples/quickstart.py --output-dir outputs

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
