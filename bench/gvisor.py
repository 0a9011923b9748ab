"""What gVisor costs: the Docker backend under runsc beside the same backend under runc, in one
run (cold starts alternating between the two; the `1+1` round trips and the pandas workload, a
frame of a million rows made and grouped, runc's samples then runsc's).

Each figure is reported as runsc's median over runc's (docs/gvisor.md quotes them).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import docker

from bench.stats import timed
from code_interpreter_wire.spec import SandboxSpec
from sandbox import Sandbox, create_backend

RUNC, RUNSC = "runc", "runsc"
TRIVIAL = "1+1"
PANDAS = (
    "import numpy as np, pandas as pd\n"
    "rng = np.random.default_rng(0)\n"
    "n = 1_000_000\n"
    "frame = pd.DataFrame({'key': rng.integers(0, 1000, n), 'value': rng.random(n)})\n"
    "len(frame.groupby('key')['value'].agg(['mean', 'sum', 'count']))"
)
PANDAS_SETUP = "import numpy as np, pandas as pd"  # the import is not the workload
MEASURES = ("cold session start", "1+1 round trip", "pandas: 1e6-row frame, groupby")


def why_unavailable() -> str | None:
    """Why gVisor cannot be measured here, or None."""
    try:
        runtimes = docker.from_env().info().get("Runtimes") or {}
    except docker.errors.DockerException as exc:
        return f"no Docker engine: {exc}"
    if RUNSC not in runtimes:
        return "the engine has no runsc runtime (scripts/ensure-docker-engine.sh registers it)"
    return None


async def measure(starts: int, runs: int) -> dict[str, dict[str, list[float]]]:
    """Samples of each measure (MEASURES) under each runtime: {measure: {runtime: seconds}}."""
    backend = create_backend("docker", orchestrator_id="bench")
    out: dict[str, dict[str, list[float]]] = {m: {RUNC: [], RUNSC: []} for m in MEASURES}
    try:
        for _ in range(starts):  # alternated: drift in the machine's load hits both alike
            for runtime in (RUNC, RUNSC):
                t = time.perf_counter()
                sb = await backend.create(SandboxSpec(runtime=runtime))
                out[MEASURES[0]][runtime].append(time.perf_counter() - t)
                await sb.close()
        for runtime in (RUNC, RUNSC):
            async with await backend.create(SandboxSpec(runtime=runtime)) as sb:
                await _expect(sb, PANDAS_SETUP, None)
                out[MEASURES[1]][runtime] = await timed(runs, _run(sb, TRIVIAL, "2"))
                out[MEASURES[2]][runtime] = await timed(
                    max(5, runs // 20), _run(sb, PANDAS, "1000"), warmup=1
                )
    finally:
        await backend.close()
    return out


def _run(sb: Sandbox, code: str, text: str) -> Callable[[], Awaitable[None]]:
    async def once() -> None:
        await _expect(sb, code, text)

    return once


async def _expect(sb: Sandbox, code: str, text: str | None) -> None:
    """Run `code`; it must succeed with `text` as its value: a figure of a failure is none."""
    ex = await sb.execute(code, timeout_s=300)
    assert ex.error is None and ex.text == text, (ex.error, ex.stdout, ex.stderr, ex.text)
