"""What the display forms tests run first in a child interpreter: IPython's shell with the
kernel's display forms file loaded into it, as a kernel has it before any user code."""

from __future__ import annotations

from pathlib import Path

FORMS = Path(__file__).parents[3] / "sandbox" / "inside_kernel" / "display_forms.py"
SHELL = (
    "from IPython.core.interactiveshell import InteractiveShell\n"
    "shell = InteractiveShell.instance()\n"
)
LOAD_FORMS = (
    f"exec(compile(open({str(FORMS)!r}).read(), 'display_forms.py', 'exec'), "
    "{'__name__': 'forms'})\n"
)
SHELL_WITH_FORMS = SHELL + LOAD_FORMS
