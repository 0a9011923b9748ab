"""The names and labels of the kernel images, and the fixed paths of the kernels in them.

The sandbox layer reads them of an image (its languages, where its kernels are); the image
builder (kernel_images/, a layer above) builds the images to match. Free of our imports.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

KERNEL_IMAGE = "code-interpreter-kernel:latest"
FULL_IMAGE = "code-interpreter-kernel-full:latest"
# The kernels' PATH in these images (their Dockerfile's ENV says the same): the kernel's Python
# first; last, the commands installed in the workspace (`npm i -g`, `pip install`:
# sandbox/install_places.py's USER_BINS_IN_SANDBOX).
IMAGE_PATH = (
    "/opt/kernel/bin:/usr/local/bin:/usr/bin:/bin"
    ":/home/user/.local/bin:/home/user/.local/lib/python3/site-packages/bin"
)

# What each image built here is (the builder's label): kernel, full, template...
IMAGE_ROLE_LABEL = "code-interpreter.image"
# Templates: images an operator built FROM one of these with a Dockerfile of their own
# (`code-interpreter template build`), named by this prefix and the template's name (one of
# Docker's name components, so that the image's name is one).
TEMPLATE_IMAGE_PREFIX = "code-interpreter-template-"
TEMPLATE_LABEL = "code-interpreter.template"  # on a template image: its name
TEMPLATE_NAME = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TEMPLATE_IMAGE = re.compile(re.escape(TEMPLATE_IMAGE_PREFIX) + r"(.{1,63}):latest")


def template_image(name: str) -> str:
    """The image a template of this name is."""
    return f"{TEMPLATE_IMAGE_PREFIX}{name}:latest"


def template_name_of(image: str) -> str | None:
    """The template an image name is (exactly `code-interpreter-template-NAME:latest`), or
    None: no other tag, digest or registry names one."""
    found = _TEMPLATE_IMAGE.fullmatch(image)
    if found is None or not TEMPLATE_NAME.fullmatch(found.group(1)):
        return None
    return found.group(1)


def named_template(labels: Mapping[str, str] | None, tags: list[str]) -> str | None:
    """The template an image is, when its name tags it (an image built FROM a template
    inherits its label without being it), else None."""
    name = (labels or {}).get(TEMPLATE_LABEL, "")
    return name if name and template_image(name) in tags else None


def is_template_labelled(labels: Mapping[str, str] | None, name: str) -> bool:
    """Whether an image's labels say it is the template `name`, built by the CLI."""
    given = labels or {}
    return given.get(IMAGE_ROLE_LABEL) == "template" and given.get(TEMPLATE_LABEL) == name


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
