"""The microvm backend: each sandbox a QEMU virtual machine of its own (docs/microvm.md)."""
