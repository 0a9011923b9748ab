"""`python -m orchestrator`: the `code-interpreter` command."""

from orchestrator.entry import main

main()
