"""Per-call environment variables and working directory, in each kernel's own language.

An execution may set variables and a working directory for itself alone (E2B's per-call `envs`,
our `env`/`cwd`): the driver runs a language's `enter` code before the call and its `exit` code
after, and `set_env` code when the sandbox's own variables change while kernels run. Every value
travels as a string literal of the kernel's language, built here from JSON (whose string syntax
R, JavaScript and Java read as their own), never pasted in raw.

Bash's kernel types the code into an interactive shell on a terminal, where a control
character is a keystroke: values go there in ANSI-C quoting (`$'...'`) with every byte outside
printable ASCII written as `\\xHH`, so the code itself is printable ASCII only.

Java cannot change its process environment: `System.getenv()` is made to show the new values
by writing into the map it reads (the kernel starts with `java.base` opened for that), each
value built from pieces (JShell refuses a string constant over 64 KiB). As in E2B's Java kernel,
the variables are system properties too (`System.getProperty`), the sandbox's from the start.
Nor can a JVM change its working directory (`user.dir` is read once, at start): a per-call
directory is refused in Java.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass

from code_interpreter_wire.errors import ScopeRefused
from code_interpreter_wire.languages import PYTHON

# The helper module the Python kernel's start-up file installs (inside_kernel/startup.py).
_PYTHON_RUNTIME = "__import__('_cir_runtime')"
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Scope:
    enter: str
    exit: str


def _text(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _shell_word(value: str) -> str:
    """`value` as one bash word of printable ASCII only (ANSI-C quoting)."""
    out = []
    for byte in value.encode("utf-8", "surrogateescape"):
        char = chr(byte)
        if char in "'\\" or not 0x20 <= byte < 0x7F:
            out.append(f"\\x{byte:02x}")
        else:
            out.append(char)
    return "$'" + "".join(out) + "'"


# Pieces of a Java string: each a constant well under JShell's 65,535 bytes of modified UTF-8.
_JAVA_PIECE = 8000


def _java_text(value: str) -> str:
    if len(value) <= _JAVA_PIECE:
        return _text(value)
    pieces = ", ".join(_text(value[i : i + _JAVA_PIECE]) for i in range(0, len(value), _JAVA_PIECE))
    return f'String.join("", {pieces})'


def scope(language: str, env: dict[str, str], cwd: str | None) -> Scope:
    """The code that applies `env` and `cwd` for one call, and the code that undoes it."""
    if cwd is not None and posixpath.isabs(cwd) and "PWD" not in env and language != "bash":
        # A shell the code starts (`!pwd`) trusts $PWD while it names the directory it is in:
        # it says the directory as given (/home/user), not another path to it (/workspace).
        # (Bash's own `cd` sets it.)
        env = {**env, "PWD": cwd}
    if language == PYTHON:
        enter = f"{_PYTHON_RUNTIME}.enter({dict(env)!r}, {cwd!r})"
        return Scope(enter, f"{_PYTHON_RUNTIME}.exit()")
    if language == "bash":
        return _bash_scope(env, cwd)
    if language == "r":
        return _r_scope(env, cwd)
    if language in ("javascript", "typescript"):
        return _deno_scope(env, cwd)
    if language == "java":
        return _java_scope(env, cwd)
    raise ScopeRefused(f"per-call variables are not supported in {language}")


def set_env(language: str, env: dict[str, str]) -> str:
    """The code that sets the sandbox's variables in a running kernel, for good."""
    if language == PYTHON:
        return f"import os as _o; _o.environ.update({env!r}); del _o"
    if language == "bash":
        _check_shell_names(env)
        return "\n".join(f"export {k}={_shell_word(v)}" for k, v in env.items()) or ":"
    if language == "r":
        return f"invisible(do.call(Sys.setenv, as.list(c({_r_pairs(env)}))))"
    if language in ("javascript", "typescript"):
        return f"for (const [k, v] of Object.entries({json.dumps(env)})) Deno.env.set(k, v);"
    if language == "java":
        puts = (
            f"{{ var k = {_java_text(k)}; var v = {_java_text(v)};"
            " __cirEnv.put(k, v); System.setProperty(k, v); }"
            for k, v in env.items()
        )
        return _JAVA_ENV_MAP + "".join(puts)
    raise ScopeRefused(f"cannot set variables in {language}")


def change_directory(language: str, path: str) -> str | None:
    """The code that moves a running kernel to `path` for good; None where a kernel cannot
    move (a JVM keeps the directory it started in)."""
    # $PWD too: a shell the code starts names the directory by it (see `scope`).
    if language == PYTHON:
        return f"import os as _o; _o.chdir({path!r}); _o.environ['PWD'] = {path!r}; del _o"
    if language == "bash":
        return f"cd -- {_shell_word(path)}"
    if language == "r":
        return f"invisible(setwd({_text(path)})); invisible(Sys.setenv(PWD = {_text(path)}))"
    if language in ("javascript", "typescript"):
        return f"Deno.chdir({_text(path)}); Deno.env.set('PWD', {_text(path)});"
    return None


def _check_shell_names(env: dict[str, str]) -> None:
    for name in env:
        if not _SHELL_NAME.match(name):
            raise ScopeRefused(f"bash cannot hold a variable named {name!r}")


def _bash_scope(env: dict[str, str], cwd: str | None) -> Scope:
    _check_shell_names(env)
    enter, exit_ = ["__cir_pwd=$PWD"], []
    for i, (name, value) in enumerate(env.items()):
        enter.append(
            f'if [ -n "${{{name}+x}}" ]; then __cir_v{i}="${name}"; __cir_h{i}=1; '
            f"else __cir_h{i}=0; fi; export {name}={_shell_word(value)}"
        )
        exit_.append(
            f'if [ "$__cir_h{i}" = 1 ]; then export {name}="$__cir_v{i}"; else unset {name}; fi; '
            f"unset __cir_v{i} __cir_h{i}"
        )
    if cwd is not None:
        enter.append(f"cd -- {_shell_word(cwd)}")
        exit_.append('cd -- "$__cir_pwd"')
    exit_.append("unset __cir_pwd")
    return Scope("\n".join(enter), "\n".join(exit_))


def _r_pairs(env: dict[str, str]) -> str:
    return ", ".join(f"{_text(k)} = {_text(v)}" for k, v in env.items())


def _r_scope(env: dict[str, str], cwd: str | None) -> Scope:
    names = ", ".join(_text(k) for k in env)
    # as.character(): with no names, c() is NULL, and Sys.getenv(NULL) is every variable.
    enter = [f".cir_prev <- Sys.getenv(as.character(c({names})), unset = NA, names = TRUE)"]
    enter.append(".cir_wd <- getwd()")
    if cwd is not None:  # first: a directory that is not there stops the call before its $PWD
        enter.append(f"invisible(setwd({_text(cwd)}))")
    if env:
        enter.append(f"invisible(do.call(Sys.setenv, as.list(c({_r_pairs(env)}))))")
    exit_ = (
        "for (.cir_k in names(.cir_prev)) if (is.na(.cir_prev[[.cir_k]])) Sys.unsetenv(.cir_k) "
        "else do.call(Sys.setenv, setNames(list(.cir_prev[[.cir_k]]), .cir_k))\n"
        "invisible(setwd(.cir_wd))\n"
        "rm(list = intersect(c('.cir_prev', '.cir_wd', '.cir_k'), ls(all.names = TRUE)))"
    )
    return Scope("\n".join(enter), exit_)


def _deno_scope(env: dict[str, str], cwd: str | None) -> Scope:
    enter = (
        f"globalThis.__cirScope = {{ env: Object.fromEntries({json.dumps(list(env))}"
        ".map((k) => [k, Deno.env.get(k)])), cwd: Deno.cwd() };\n"
        + (f"Deno.chdir({json.dumps(cwd)});\n" if cwd is not None else "")
        + f"for (const [k, v] of Object.entries({json.dumps(env)})) Deno.env.set(k, v);\n"
    )
    exit_ = (
        "{ const s = globalThis.__cirScope; delete globalThis.__cirScope;\n"
        "  for (const [k, v] of Object.entries(s.env)) {"
        " if (v === undefined) Deno.env.delete(k); else Deno.env.set(k, v); }\n"
        "  Deno.chdir(s.cwd); }\n"
    )
    return Scope(enter + "undefined;", exit_ + "undefined;")


# The map behind System.getenv(): writable once java.base/java.util is opened to the kernel.
_JAVA_ENV_MAP = (
    "java.util.Map<String, String> __cirEnv = ((java.util.function.Supplier<java.util.Map<"
    "String, String>>) () -> { try { var e = System.getenv();"
    ' var f = e.getClass().getDeclaredField("m"); f.setAccessible(true);'
    ' @SuppressWarnings("unchecked") var m = (java.util.Map<String, String>) f.get(e);'
    " return m; } catch (ReflectiveOperationException x) {"
    " throw new IllegalStateException(x); } }).get();\n"
)


def _java_scope(env: dict[str, str], cwd: str | None) -> Scope:
    if cwd is not None:
        raise ScopeRefused(
            "a per-call working directory is not possible in Java (a JVM keeps the directory "
            "it started in, /workspace): use paths under it, or absolute ones"
        )
    enter = [
        _JAVA_ENV_MAP,
        "java.util.Map<String, String> __cirPrev = new java.util.HashMap<>();",
        "java.util.Map<String, String> __cirPrevProp = new java.util.HashMap<>();",
    ]
    for name, value in env.items():
        enter.append(
            f"{{ var k = {_java_text(name)}; var v = {_java_text(value)};"
            " __cirPrev.put(k, __cirEnv.put(k, v));"
            " __cirPrevProp.put(k, System.setProperty(k, v)); }"
        )
    exit_ = (
        "__cirPrev.forEach((k, v) -> {"
        " if (v == null) __cirEnv.remove(k); else __cirEnv.put(k, v); });"
        " __cirPrevProp.forEach((k, v) -> {"
        " if (v == null) System.clearProperty(k); else System.setProperty(k, v); });"
    )
    return Scope("\n".join(enter), exit_)


# JShell code each Java kernel runs as it starts (jjava's JJAVA_STARTUP_SCRIPT): its variables
# as system properties too, as E2B's Java kernel has the sandbox's (`System.getProperty("NAME")`);
# none that is one already is changed. Constant, whatever the variables: nothing of theirs is
# pasted into code, and no list of names can outgrow an environment string.
JAVA_STARTUP_SCRIPT = (
    "System.getenv().forEach((k, v) -> { if (!k.isEmpty() && System.getProperty(k) == null)"
    " System.setProperty(k, v); });"
)
