"""Per-call environment variables and working directory, in each kernel's own language.

An execution may set variables and a working directory for itself alone (E2B's per-call `envs`,
our `env`/`cwd`): the driver runs a language's `enter` code before the call and its `exit` code
after, and `set_env` code when the sandbox's own variables change while kernels run. Every value
travels as a string literal of the kernel's language, built here from JSON (whose string syntax
R, JavaScript and Java read as their own), never pasted in raw.

Java cannot change its process environment: `System.getenv()` is made to show the new values
by writing into the map it reads (the kernel starts with `java.base` opened for that), and a
working directory sets `user.dir`, which relative `File`s and `Path`s resolve against.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from sandbox.errors import ScopeRefused
from sandbox.languages import PYTHON

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
    return "'" + value.replace("'", "'\\''") + "'"


def scope(language: str, env: dict[str, str], cwd: str | None) -> Scope:
    """The code that applies `env` and `cwd` for one call, and the code that undoes it."""
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
        puts = (f"__cirEnv.put({_text(k)}, {_text(v)});" for k, v in env.items())
        return _JAVA_ENV_MAP + "".join(puts)
    raise ScopeRefused(f"cannot set variables in {language}")


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
    enter = [f".cir_prev <- Sys.getenv(c({names}), unset = NA, names = TRUE)"]
    if env:
        enter.append(f"invisible(do.call(Sys.setenv, as.list(c({_r_pairs(env)}))))")
    enter.append(".cir_wd <- getwd()")
    if cwd is not None:
        enter.append(f"invisible(setwd({_text(cwd)}))")
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
        f"for (const [k, v] of Object.entries({json.dumps(env)})) Deno.env.set(k, v);\n"
        + (f"Deno.chdir({json.dumps(cwd)});\n" if cwd is not None else "")
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
    enter = [_JAVA_ENV_MAP, "java.util.Map<String, String> __cirPrev = new java.util.HashMap<>();"]
    for name, value in env.items():
        enter.append(f"__cirPrev.put({_text(name)}, __cirEnv.put({_text(name)}, {_text(value)}));")
    enter.append('String __cirDir = System.getProperty("user.dir");')
    if cwd is not None:
        enter.append(f'System.setProperty("user.dir", {_text(cwd)});')
    exit_ = (
        "__cirPrev.forEach((k, v) -> {"
        " if (v == null) __cirEnv.remove(k); else __cirEnv.put(k, v); });\n"
        'System.setProperty("user.dir", __cirDir);'
    )
    return Scope("\n".join(enter), exit_)
