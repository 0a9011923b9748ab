"""How each language's Jupyter kernel is talked to, and whether a sandbox has it.

A session holds at most one kernel per language, all in the same sandbox boundary and sharing the
workspace; Python's starts with the sandbox, every other language's on first use. The names are
the wire's (code_interpreter_wire/languages.py); which languages a sandbox actually has depends on
what its backend finds installed (sandbox/kernel/programs.py): asking for another is a
`LanguageUnavailable` naming the ones there are.
"""

from __future__ import annotations

from dataclasses import dataclass

from code_interpreter_wire.errors import LanguageUnavailable
from code_interpreter_wire.languages import LANGUAGES, canonical_language


@dataclass(frozen=True)
class KernelTraits:
    """What the sandbox must do differently for one language's kernel."""

    # The kernel binds TCP only (Deno, jjava's JeroMQ): a supervisor in the sandbox relays its
    # sockets to the ipc sockets the host reaches (inside_kernel/kernel_supervisor.py).
    relayed: bool = False
    # The kernel ignores Jupyter's interrupt_request (IRkernel): the supervisor turns an
    # interrupt into SIGINT instead.
    interrupt_by_signal: bool = False
    # The kernel may publish a call's output after its idle status, even under the next
    # request's id (Deno's: its output goes through a queue of its own): a flush request after
    # each call proves all of it is in (sandbox/kernel/late_output.py).
    late_output: bool = False

    @property
    def supervised(self) -> bool:
        return self.relayed or self.interrupt_by_signal


_PLAIN = KernelTraits()
_TRAITS: dict[str, KernelTraits] = {
    "javascript": KernelTraits(relayed=True, late_output=True),
    "typescript": KernelTraits(relayed=True, late_output=True),
    "r": KernelTraits(interrupt_by_signal=True),
    "java": KernelTraits(relayed=True),
}
# Every language the wire names has traits here, most of them the plain ones.
KERNEL_TRAITS: dict[str, KernelTraits] = {name: _TRAITS.get(name, _PLAIN) for name in LANGUAGES}


def check_available(language: str, available: list[str]) -> str:
    """`language` in canonical form, if this sandbox has it; else a clear refusal."""
    name = canonical_language(language)
    if name not in available:
        raise LanguageUnavailable(
            f"language {name!r} is not installed in this sandbox; it has: "
            f"{', '.join(available)}. Other languages need a sandbox image or host that has "
            "their kernels (the Docker backend's full image, `code-interpreter-kernel-full`, has "
            "every language)."
        )
    return name
