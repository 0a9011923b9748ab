"""The languages a session can run, by name: their canonical names, aliases and script suffixes.

Both sides read names the same way (the service checks a request's `language`, the client
and the CLI name one); how each kernel is started and talked to is the sandbox's business
(sandbox/languages.py), and which ones a sandbox has depends on what its backend finds installed.
"""

from __future__ import annotations

from dataclasses import dataclass

from code_interpreter_wire.errors import UnknownLanguage

PYTHON = "python"


@dataclass(frozen=True)
class Language:
    """One language: its canonical name, what else it answers to, and its script suffixes."""

    name: str
    aliases: tuple[str, ...]
    # Script suffixes that name this language (the CLI's `run -f script.R`).
    suffixes: tuple[str, ...]


LANGUAGES: dict[str, Language] = {
    language.name: language
    for language in (
        Language(PYTHON, ("py", "python3", "ipython"), (".py",)),
        Language("bash", ("sh", "shell"), (".sh", ".bash")),
        Language("javascript", ("js", "deno", "node"), (".js", ".mjs")),
        Language("typescript", ("ts",), (".ts",)),
        Language("r", ("R",), (".r", ".R")),
        Language("java", (), (".java", ".jsh")),
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
