"""Files that run *inside* a sandbox's kernel, not in the service: standard library only.

They are copied or bound into each sandbox as they are (`display_forms.py`, then `startup.py`,
run in Python's kernel before any user code; `host_tools.py` is the module sandboxed code imports
to call the host's tools).
"""
