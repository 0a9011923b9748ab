"""Processes in a sandbox beside its kernel: commands, background processes and terminals.

Every backend starts them inside the same boundary as the kernel (namespaces or container, uid,
cgroup, limits, workspace, no network); what follows a process once it runs (its output, kept
within caps; its input; signals; its end; its time limit) is the same code for all of them.
"""
