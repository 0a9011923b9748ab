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
import contextlib
import importlib.util
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager

from bench import raw, report
from bench.interleave import Measure, Sampled, Untimed, interleaved, quiet
from bench.ours import backend
from bench.stats import beside
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
    return (1, 10) if quick else (12, 200)


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
    return await raw.start(f"bench-{language}", specs)


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


async def _raw_cold(specs: KernelSpecManager, language: str, after: Untimed) -> None:
    km, kc = await _start_raw(specs, language)
    after.later(partial(raw.stop, km, kc))  # stopped untimed, as our sandboxes are closed
    await _run_raw(kc, TRIVIAL[language])


# --- ours: the same kernels, in our sandboxes


async def _answer(sb: Sandbox, language: str) -> None:
    ex = await sb.execute(TRIVIAL[language], language=language)
    # IRkernel shows a value as a display, not as the cell's result.
    shown = "".join(r.text or "" for r in ex.results) + ex.stdout
    assert ex.ok and shows_two(shown), ex


class _OurCold:
    """A fresh sandbox per sample, closed untimed (by `after`) before the next sample of any
    measure. Python's kernel starts with the sandbox, so its creation is timed; another
    language's sandbox is made untimed first, then its first call (which starts its kernel) is
    timed."""

    def __init__(self, b: Backend, spec: SandboxSpec, language: str, after: Untimed) -> None:
        self.b, self.spec, self.language, self.after = b, spec, language, after
        self.sb: Sandbox | None = None

    async def prepare(self) -> None:
        await self.after.run()
        if self.language != PYTHON:
            self.sb = await self.b.create(self.spec)
        await quiet()  # the last sample's teardown (a container removed) is over

    async def once(self) -> None:
        if self.sb is None:
            self.sb = await self.b.create(self.spec)
        sb, self.sb = self.sb, None
        self.after.later(sb.close)
        await _answer(sb, self.language)


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


async def measure(
    starts: int, runs: int, only: tuple[str, ...] = tuple(LANGUAGES)
) -> dict[str, Any]:
    """Each language's figures, the floor's and every backend's (Docker: the full image) taken
    in turns (bench/interleave.py): cold starts, then round trips on kernels all started."""
    rows: list[dict[str, Any]] = []
    not_run: dict[str, str] = {}
    programs = host_kernels()
    on_host = programs.languages
    async with contextlib.AsyncExitStack() as stack:
        walls: dict[str, tuple[Backend, SandboxSpec, tuple[str, ...]]] = {}
        for name in ("local", "docker"):
            why = why_unavailable(name) or (_full_image_missing() if name == "docker" else None)
            if why:
                not_run[f"every language ({name})"] = why
                continue
            spec = SandboxSpec(image=FULL_IMAGE) if name == "docker" else SandboxSpec()
            b = backend(name)
            stack.push_async_callback(b.close)
            walls[name] = (b, spec, tuple(await b.languages(spec)))
        specs = stack.enter_context(_kernel_specs(programs))
        for language in only:
            if language not in on_host:
                not_run[f"{language} (raw, local)"] = "its kernel is not installed on this host"
                continue
            here = {}
            for name, (b, spec, has) in walls.items():
                if language in has:
                    here[name] = (b, spec)
                else:
                    not_run[f"{language} ({name})"] = (
                        "the full image has no kernel for it"
                        if name == "docker"
                        else "its kernel is not installed on this host"
                    )
            rows += await _one_language(specs, language, here, starts, runs)
    return {"rows": rows, "not_run": not_run, "languages": list(only)}


async def _one_language(
    specs: KernelSpecManager,
    language: str,
    walls: dict[str, tuple[Backend, SandboxSpec]],
    starts: int,
    runs: int,
) -> list[dict[str, Any]]:
    after = Untimed()
    colds = {name: _OurCold(b, spec, language, after) for name, (b, spec) in walls.items()}

    try:
        cold = await interleaved(
            {
                "raw": Measure(partial(_raw_cold, specs, language, after), after.settle),
                **{name: Measure(c.once, c.prepare) for name, c in colds.items()},
            },
            starts,
            batch=1,
            warmup=0,
        )
    finally:
        await after.run()
    async with contextlib.AsyncExitStack() as stack:
        km, kc = await _start_raw(specs, language)
        stack.push_async_callback(raw.stop, km, kc)
        trips = {"raw": Measure(partial(_run_raw, kc, TRIVIAL[language]))}
        for name, (b, spec) in walls.items():
            sb = await stack.enter_async_context(await b.create(spec))
            trips[name] = Measure(partial(_answer, sb, language))
        round_trip = await interleaved(trips, runs)
    return [
        _row(language, who, {"cold": cold[who], "round_trip": round_trip[who]}, cold, round_trip)
        for who in cold
    ]


def _row(
    language: str,
    who: str,
    mine: dict[str, Sampled],
    cold: dict[str, Sampled],
    round_trip: dict[str, Sampled],
) -> dict[str, Any]:
    out: dict[str, Any] = {"language": language, "who": who}
    for key, floor in (("cold", cold["raw"]), ("round_trip", round_trip["raw"])):
        out[key] = {"samples": mine[key].wall, **beside(mine[key], floor)}
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, for a smoke run")
    args = parser.parse_args()
    print("\n".join(report.languages_section(asyncio.run(measure(*samples(args.quick))))))
