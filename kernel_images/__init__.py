"""Builds the sandbox images: a registry-free Debian base, the data-analysis kernel image and
the full image with every language's kernel. `labels` holds what the sandbox layer reads."""

from kernel_images.labels import (
    DENO_IN_IMAGE,
    FULL_IMAGE,
    FULL_IMAGE_LANGUAGES,
    JAVA_IN_IMAGE,
    JJAVA_JAR_IN_IMAGE,
    KERNEL_IMAGE,
    KERNEL_IMAGE_LANGUAGES,
    LANGUAGES_LABEL,
    R_IN_IMAGE,
    languages_of,
)

__all__ = [
    "DENO_IN_IMAGE",
    "FULL_IMAGE",
    "FULL_IMAGE_LANGUAGES",
    "JAVA_IN_IMAGE",
    "JJAVA_JAR_IN_IMAGE",
    "KERNEL_IMAGE",
    "KERNEL_IMAGE_LANGUAGES",
    "LANGUAGES_LABEL",
    "R_IN_IMAGE",
    "languages_of",
]
