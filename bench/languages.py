"""Every language's kernel beside Python's: its cold start and its trivial round trip, through our
sandboxes and against the same kernel driven directly by jupyter_client (TCP, no sandbox, no
service), all measured in the same run.

Cold start: in a sandbox that is already running (Python's kernel started with it, untimed), the
time from the first call in the language to its result, starting the language's kernel included.
Each sample is a fresh sandbox: `restart(language)` starts the new kernel before it returns, so
the first call after it would not pay for the start. Python's kernel starts with the sandbox, so
Python's cold start is the sandbox's creation plus its first call. The floor's cold start is the
kernel's start (ready to answer) plus its first call.

Round trip: the language's own trivial expression, many times, in one sandbox whose kernel is
already started; the floor's, on one kernel started directly.

`python -m bench.languages [--quick]` runs this part alone and prints its table.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from bench import raw, report
from bench.ours import backend
from bench.stats import summarize, timed
from code_interpreter_wire.languages import LANGUAGES, PYTHON
from code_interpreter_wire.spec import ResourceLimits, SandboxSpec
from sandbox import Backend, Sandbox
from sandbox.backends.registry import why_unavailable
from sandbox.image_labels import FULL_IMAGE
from sandbox.inside_kernel.kernel_supervisor import PLACEHOLDER
from sandbox.kernel.programs import KernelPrograms, host_programs, language_environment
from sandbox.languages import KERNEL_TRAITS

# Each language's trivial expression; every one of them shows a 2.
TRIVIAL = {
    "python": "1+1",
    "bash": "echo $((1+1))",
    "javascript": "1+1",
    "typescript": "1+1",
    "r": "1+1",
    "java": "1+1",
}
START_TIMEOUT_S = 120.0


def shows_two(text: str) -> bool:
    """Whether a trivial call's output is its answer (R prints `[1] 2`, bash `2` and a newline)."""
    return text.strip().removeprefix("[1]").strip() == "2"


def samples(quick: bool) -> tuple[int, int]:
    """How many cold starts and round trips per language and backend: each cold start costs
    seconds (Java's most), so fewer than Python's in the latency table; a quick run only shows
    that every language works."""
    return (1, 10) if quick else (5, 100)


# --- the floor: each host kernel started and driven by jupyter_client, no sandbox


def host_kernels() -> KernelPrograms:
    """The kernels this host has, found as the local backend finds them."""
    return host_programs(
        sys.executable,
        sys.prefix,
        importlib.util.find_spec("bash_kernel") is not None,
        startup_file="",
        supervisor="",
    )


def bare_argv(programs: KernelPrograms, language: str) -> list[str]:
    """The kernel's own command line, as our sandboxes start it, without the supervisor our
    sandboxes put in front of some kernels (the floor has no sandbox to relay into)."""
    argv = programs.command(language, PLACEHOLDER, "", ResourceLimits())
    if KERNEL_TRAITS[language].supervised:
        argv = argv[argv.index("--") + 1 :]
    return argv


@contextmanager
def _kernel_specs(programs: KernelPrograms) -> Iterator[KernelSpecManager]:
    """A kernel spec per language (but Python's, which is ipykernel's own), in a directory of
    their own, so jupyter_client starts exactly our command lines."""
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as root:
        for language in programs.languages:
            if language == PYTHON:
                continue
            spec_dir = Path(root, f"bench-{language}")
            spec_dir.mkdir()
            spec = {
                "argv": bare_argv(programs, language),
                "display_name": language,
                "language": language,
                "env": language_environment(language),
            }
            (spec_dir / "kernel.json").write_text(json.dumps(spec))
        yield KernelSpecManager(kernel_dirs=[root])


async def _start_raw(specs: KernelSpecManager, language: str) -> tuple[Any, Any]:
    if language == PYTHON:
        return await raw.start()
    km = AsyncKernelManager(kernel_name=f"bench-{language}", kernel_spec_manager=specs)
    await km.start_kernel(stderr=subprocess.DEVNULL)
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=START_TIMEOUT_S)
    except BaseException:
        await raw.stop(km, kc)
        raise
    return km, kc


async def _run_raw(kc: Any, code: str) -> None:
    """Execute and wait until the answer is in hand: Deno's kernel may publish it after its
    idle status, so the floor reads on until it comes, as our driver does."""
    seen: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            seen.append(content["text"])
        elif kind in ("execute_result", "display_data"):
            seen.append(content["data"].get("text/plain", ""))

    reply = await kc.execute_interactive(code, output_hook=hook, timeout=START_TIMEOUT_S)
    assert reply["content"]["status"] == "ok", reply["content"]
    while not shows_two("".join(seen)):
        hook(await kc.get_iopub_msg(timeout=30))


async def raw_figures(
    specs: KernelSpecManager, language: str, starts: int, runs: int
) -> dict[str, list[float]]:
    code = TRIVIAL[language]
    cold: list[float] = []
    for sample in range(starts):
        t = time.perf_counter()
        km, kc = await _start_raw(specs, language)
        try:
            await _run_raw(kc, code)
            cold.append(time.perf_counter() - t)
            if sample == starts - 1:
                return {"cold": cold, "round_trip": await timed(runs, partial(_run_raw, kc, code))}
        finally:
            await raw.stop(km, kc)
    raise AssertionError("unreachable")


# --- ours: the same kernels, in our sandboxes


async def our_figures(
    b: Backend, spec: SandboxSpec, language: str, starts: int, runs: int
) -> dict[str, list[float]]:
    code = TRIVIAL[language]

    async def answer(sb: Sandbox) -> None:
        ex = await sb.execute(code, language=language)
        # IRkernel shows a value as a display, not as the cell's result.
        shown = "".join(r.text or "" for r in ex.results) + ex.stdout
        assert ex.ok and shows_two(shown), ex

    cold: list[float] = []
    for sample in range(starts):
        t = time.perf_counter()
        sb = await b.create(spec)
        try:
            if language != PYTHON:  # Python's kernel starts with the sandbox: it is timed
                t = time.perf_counter()
            await answer(sb)
            cold.append(time.perf_counter() - t)
            if sample == starts - 1:
                return {"cold": cold, "round_trip": await timed(runs, partial(answer, sb))}
        finally:
            await sb.close()
    raise AssertionError("unreachable")


def _full_image_missing() -> str | None:
    import docker
    from docker.errors import DockerException, ImageNotFound

    try:
        docker.from_env().images.get(FULL_IMAGE)
    except ImageNotFound:
        return f"the full image {FULL_IMAGE} is missing: run `make image`"
    except DockerException as exc:
        return f"no Docker engine: {exc}"
    return None


async def measure(starts: int, runs: int) -> dict[str, Any]:
    """Every language's figures: the floor, then each backend (Docker: the full image)."""
    rows: list[dict[str, Any]] = []
    not_run: dict[str, str] = {}
    programs = host_kernels()
    on_host = programs.languages
    for language in LANGUAGES:
        if language not in on_host:
            not_run[f"{language} (raw, local)"] = "its kernel is not installed on this host"

    floor: dict[str, dict[str, list[float]]] = {}
    with _kernel_specs(programs) as specs:
        for language in on_host:
            floor[language] = await raw_figures(specs, language, starts, runs)
            rows.append(_row(language, "raw", floor[language], floor[language]))

    for name in ("local", "docker"):
        why = why_unavailable(name) or (_full_image_missing() if name == "docker" else None)
        if why:
            not_run[f"every language ({name})"] = why
            continue
        spec = SandboxSpec(image=FULL_IMAGE) if name == "docker" else SandboxSpec()
        b = backend(name)
        try:
            has = await b.languages(spec)
            for language in LANGUAGES:
                if language not in has:
                    not_run[f"{language} ({name})"] = (
                        "the full image has no kernel for it"
                        if name == "docker"
                        else "its kernel is not installed on this host"
                    )
                elif language not in floor:
                    not_run[f"{language} ({name})"] = "no floor to compare with on this host"
                else:
                    mine = await our_figures(b, spec, language, starts, runs)
                    rows.append(_row(language, name, mine, floor[language]))
        finally:
            await b.close()
    return {"rows": rows, "not_run": not_run}


def _row(
    language: str, who: str, mine: dict[str, list[float]], floor: dict[str, list[float]]
) -> dict[str, Any]:
    out: dict[str, Any] = {"language": language, "who": who}
    for key in ("cold", "round_trip"):
        stats, base = summarize(mine[key]), summarize(floor[key])
        out[key] = {
            "stats": stats,
            "samples": mine[key],
            "raw_median_ms": base["median_ms"],
            "ratio": stats["median_ms"] / base["median_ms"],
        }
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, for a smoke run")
    args = parser.parse_args()
    print("\n".join(report.languages_section(asyncio.run(measure(*samples(args.quick))))))
