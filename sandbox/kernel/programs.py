"""Where each language's kernel lives in a sandbox, and the command line that starts it.

The Docker backend knows an image's languages from its label and uses fixed paths (the images
put every kernel there: docs/images.md); the local backend looks at what its host has, once.
Either way the result is a `KernelPrograms`, and the command lines are built here alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from code_interpreter_wire.errors import BackendUnavailable
from code_interpreter_wire.languages import LANGUAGES, PYTHON
from code_interpreter_wire.spec import ResourceLimits
from sandbox.image_labels import (
    DENO_IN_IMAGE,
    JAVA_IN_IMAGE,
    JJAVA_JAR_IN_IMAGE,
    R_IN_IMAGE,
    is_template_labelled,
    languages_of,
    template_name_of,
)
from sandbox.inside_kernel import command_server, kernel_supervisor
from sandbox.kernel.command import kernel_command
from sandbox.kernel.scopes import JAVA_STARTUP_SCRIPT
from sandbox.languages import KERNEL_TRAITS

SUPERVISOR_FILE = Path(kernel_supervisor.__file__)
SUPERVISOR_IN_SANDBOX = "/opt/code-interpreter/kernel_supervisor.py"
# What runs a sandbox's commands from inside it (local and Docker under runc).
COMMAND_SERVER_FILE = Path(command_server.__file__)
COMMAND_SERVER_IN_SANDBOX = "/opt/code-interpreter/command_server.py"
# The supervisor's interrupt socket, in the kernel's directory.
INTERRUPT_SOCKET = "interrupt"
# Where the images put jjava's jar: in the kernel's Python environment, as `pip install jjava`
# does.
JJAVA_JAR_IN_PREFIX = "share/jupyter/kernels/java/jjava.jar"
IRKERNEL_LIBRARIES = (
    "/usr/lib/R/site-library",
    "/usr/local/lib/R/site-library",
    "/usr/lib/R/library",
)


@dataclass(frozen=True)
class KernelPrograms:
    """The programs of one sandbox's kernels, as paths inside the sandbox. None: not there."""

    python: str
    startup_file: str
    supervisor: str = SUPERVISOR_IN_SANDBOX
    bash_kernel: bool = False
    deno: str | None = None
    java: str | None = None
    jjava_jar: str | None = None
    r: str | None = None

    @property
    def languages(self) -> list[str]:
        """The canonical names of the languages these programs run, Python first."""
        has = {
            PYTHON: True,
            "bash": self.bash_kernel,
            "javascript": self.deno is not None,
            "typescript": self.deno is not None,
            "r": self.r is not None,
            "java": self.java is not None and self.jjava_jar is not None,
        }
        return [name for name in LANGUAGES if has[name]]

    def command(
        self, language: str, connection_file: str, kernel_dir: str, limits: ResourceLimits
    ) -> list[str]:
        """The command line of `language`'s kernel, reading `connection_file` (in-sandbox)."""
        if language == PYTHON:
            return kernel_command(self.python, connection_file, self.startup_file)
        argv = self._kernel_argv(language, limits)
        spec = KERNEL_TRAITS[language]
        if not spec.supervised:
            return [a.replace("{connection_file}", connection_file) for a in argv]
        supervisor = [self.python, self.supervisor, "--connection-file", connection_file]
        if spec.relayed:
            supervisor.append("--relay")
        if spec.interrupt_by_signal:
            supervisor += ["--interrupt-socket", f"{kernel_dir}/{INTERRUPT_SOCKET}"]
        return [*supervisor, "--", *argv]

    def _kernel_argv(self, language: str, limits: ResourceLimits) -> list[str]:
        placeholder = kernel_supervisor.PLACEHOLDER
        if language == "bash":
            return [self.python, "-m", "bash_kernel", "-f", placeholder]
        if language in ("javascript", "typescript") and self.deno:
            return [self.deno, "jupyter", "--kernel", "--conn", placeholder]
        if language == "r" and self.r:
            r_options = ["--no-echo", "--no-restore", "-e", "IRkernel::main()", "--args"]
            return [self.r, *r_options, placeholder]
        if language == "java" and self.java and self.jjava_jar:
            heap = max(64, limits.memory_mb // 2)
            return [
                self.java,
                f"-Xmx{heap}m",
                f"-XX:ActiveProcessorCount={max(1, math.ceil(limits.cpus))}",
                "-XX:+UseSerialGC",
                "-XX:-UsePerfData",
                "--add-opens=jdk.jshell/jdk.jshell=ALL-UNNAMED",
                # Per-call environment variables (sandbox/kernel/scopes.py) need these two.
                "--add-opens=java.base/java.lang=ALL-UNNAMED",
                "--add-opens=java.base/java.util=ALL-UNNAMED",
                "-jar",
                self.jjava_jar,
                placeholder,
            ]
        raise ValueError(f"no kernel for {language!r} here")


def refuse_unbuilt_template(image: str, labels: Mapping[str, str] | None) -> None:
    """BackendUnavailable for an image named as a template that the CLI did not build as that
    template (its labels say so): every backend that runs images asks before running one."""
    name = template_name_of(image)
    if name is not None and not is_template_labelled(labels, name):
        raise BackendUnavailable(
            f"the image {image!r} is not a template this service built: build templates with "
            "`code-interpreter template build`"
        )


def language_environment(language: str) -> dict[str, str]:
    """Variables a language's kernel needs beyond the common ones (the session's own come
    after them: a session that sets one of these has its own)."""
    if language == "java":  # its variables as system properties too, as E2B's has them
        return {"JJAVA_STARTUP_SCRIPT": JAVA_STARTUP_SCRIPT}
    if language in ("javascript", "typescript"):
        # Plain text results (no terminal colours), no update check: there is no network.
        return {"NO_COLOR": "1", "DENO_NO_UPDATE_CHECK": "1", "DENO_NO_PROMPT": "1"}
    if language == "r":
        return {"R_LIBS_USER": "/tmp/R/library"}
    return {}


def image_programs(labels: dict[str, str] | None, python: str, startup_file: str) -> KernelPrograms:
    """The programs of a kernel image, from its languages label (no label: Python alone), at
    the paths the images put them (sandbox/image_labels.py)."""
    listed = set(languages_of(labels))
    return KernelPrograms(
        python=python,
        startup_file=startup_file,
        bash_kernel="bash" in listed,
        deno=DENO_IN_IMAGE if listed & {"javascript", "typescript"} else None,
        java=JAVA_IN_IMAGE if "java" in listed else None,
        jjava_jar=JJAVA_JAR_IN_IMAGE if "java" in listed else None,
        r=R_IN_IMAGE if "r" in listed else None,
    )


def host_programs(
    python: str, prefix: str, has_bash_kernel: bool, startup_file: str, supervisor: str
) -> KernelPrograms:
    """The programs the local backend's host has, beside its kernel Python at `prefix`."""
    deno = _first_executable([f"{prefix}/bin/deno", "/usr/local/bin/deno", "/usr/bin/deno"])
    java = _first_executable(["/usr/bin/java"])
    jar = _first_file(
        [
            f"{prefix}/{JJAVA_JAR_IN_PREFIX}",
            f"/usr/local/{JJAVA_JAR_IN_PREFIX}",
            f"/usr/{JJAVA_JAR_IN_PREFIX}",
        ]
    )
    r = _first_executable(["/usr/bin/R"])
    if r is not None and not any(Path(lib, "IRkernel").is_dir() for lib in IRKERNEL_LIBRARIES):
        r = None
    return KernelPrograms(
        python=python,
        startup_file=startup_file,
        supervisor=supervisor,
        bash_kernel=has_bash_kernel,
        deno=deno,
        java=java,
        jjava_jar=jar,
        r=r,
    )


def _first_executable(candidates: list[str]) -> str | None:
    for candidate in candidates:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _first_file(candidates: list[str]) -> str | None:
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    return None
