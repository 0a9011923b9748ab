"""Builds the sandbox images: a registry-free Debian base, the data-analysis kernel image and
the full image with every language's kernel (build.py). What the sandbox layer reads of them
(names, labels, the kernels' paths) is sandbox/image_labels.py, which this package imports."""
