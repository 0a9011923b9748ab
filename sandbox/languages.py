"""The languages a sandbox can run, each by a Jupyter kernel of its own, and their names.

A session holds at most one kernel per language, all in the same sandbox boundary and sharing the
workspace; Python's starts with the sandbox, every other language's on first use. Which languages
a sandbox actually has depends on what its backend finds installed (sandbox/kernel/programs.py):
asking for another is a `LanguageUnavailable` naming the ones there are.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbox.errors import LanguageUnavailable, UnknownLanguage

PYTHON = "python"


@dataclass(frozen=True)
class Language:
    """One language: its canonical name, what else it answers to, and how its kernel talks."""

    name: str
    aliases: tuple[str, ...]
    # Script suffixes that name this language (the CLI's `run -f script.R`).
    suffixes: tuple[str, ...]
    # The kernel binds TCP only (Deno, jjava's JeroMQ): a supervisor in the sandbox relays its
    # sockets to the ipc sockets the host reaches (inside_kernel/kernel_supervisor.py).
    relayed: bool = False
    # The kernel ignores Jupyter's interrupt_request (IRkernel): the supervisor turns an
    # interrupt into SIGINT instead.
    interrupt_by_signal: bool = False
    # The kernel may publish a call's last output after its idle status (Deno's sends stdout
    # and the result a millisecond or two late): a call is over once its output has been
    # quiet this long after the idle.
    linger_s: float = 0.0

    @property
    def supervised(self) -> bool:
        return self.relayed or self.interrupt_by_signal


LANGUAGES: dict[str, Language] = {
    language.name: language
    for language in (
        Language(PYTHON, ("py", "python3", "ipython"), (".py",)),
        Language("bash", ("sh", "shell"), (".sh", ".bash")),
        Language(
            "javascript", ("js", "deno", "node"), (".js", ".mjs"), relayed=True, linger_s=0.05
        ),
        Language("typescript", ("ts",), (".ts",), relayed=True, linger_s=0.05),
        Language("r", ("R",), (".r", ".R"), interrupt_by_signal=True),
        Language("java", (), (".java", ".jsh"), relayed=True),
    )
}
_BY_NAME = {
    alias.lower(): language.name
    for language in LANGUAGES.values()
    for alias in (language.name, *language.aliases)
}
MAX_LANGUAGE_NAME = 40


def canonical_language(name: str | None) -> str:
    """The canonical name of `name` (None: Python); `UnknownLanguage` if it names none."""
    if name is None or name == "":
        return PYTHON
    found = _BY_NAME.get(name.strip().lower()) if len(name) <= MAX_LANGUAGE_NAME else None
    if found is None:
        shown = name if len(name) <= MAX_LANGUAGE_NAME else name[:MAX_LANGUAGE_NAME] + "..."
        raise UnknownLanguage(
            f"unknown language {shown!r}: the languages are {', '.join(LANGUAGES)} "
            "(aliases: js, ts, sh, py)"
        )
    return found


def language_for_suffix(suffix: str) -> str | None:
    """The language a script's suffix names, if any (`.R` and `.r` are both R)."""
    for language in LANGUAGES.values():
        if suffix in language.suffixes or suffix.lower() in language.suffixes:
            return language.name
    return None


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
