"""The names and labels of the kernel images, and the fixed paths of the kernels in them.

The sandbox layer reads them of an image (its languages, where its kernels are); the image
builder (kernel_images/, a layer above) builds the images to match. Free of imports.
"""

from __future__ import annotations

from collections.abc import Mapping

KERNEL_IMAGE = "code-interpreter-kernel:latest"
FULL_IMAGE = "code-interpreter-kernel-full:latest"

# Each image lists the canonical names of the languages its kernels run, comma-separated.
LANGUAGES_LABEL = "code-interpreter.languages"
KERNEL_IMAGE_LANGUAGES: tuple[str, ...] = ("python", "bash")
FULL_IMAGE_LANGUAGES: tuple[str, ...] = ("python", "bash", "javascript", "typescript", "r", "java")

# Where the full image's kernels are; the sandbox layer starts them from exactly these paths.
KERNEL_VENV_IN_IMAGE = "/opt/kernel"
DENO_IN_IMAGE = "/opt/kernel/bin/deno"
JAVA_IN_IMAGE = "/usr/bin/java"
JJAVA_JAR_IN_IMAGE = "/opt/kernel/share/jupyter/kernels/java/jjava.jar"
R_IN_IMAGE = "/usr/bin/R"


def languages_label(languages: tuple[str, ...]) -> str:
    return ",".join(languages)


def languages_of(labels: Mapping[str, str] | None) -> tuple[str, ...]:
    """The languages an image's labels name; an image built before the label existed runs
    Python only."""
    value = (labels or {}).get(LANGUAGES_LABEL)
    if value is None:
        return ("python",)
    return tuple(name.strip() for name in value.split(",") if name.strip())
