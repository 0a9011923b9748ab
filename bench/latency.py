"""The latency table's core: a session's start, `1+1` and a chart, ours beside the raw floor,
every contender live at once and sampled in turns (bench/interleave.py).

Contenders: a raw jupyter_client kernel (TCP, no sandbox, no service: the floor), each backend
through the Python API, and the service over HTTP (execute, the tool invoke, a warm-pool
hand-over) with the local backend. Then `echo hi` as a command (bench/commands.py), each beside a
plain subprocess, sampled the same way.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx

from bench import commands, first_chart, raw, workloads
from bench.interleave import Measure, Sampled, Untimed, interleaved, quiet
from bench.lean_http import LeanHttp
from bench.ours import backend
from bench.served import API_KEY, served
from sandbox import Backend, Sandbox

RAW_START = "raw: kernel start"
RAW_TRIVIAL = "raw: 1+1 round trip"
RAW_FIGURE = "raw: matplotlib figure, PNG in hand"
RAW_ECHO = "raw: echo hi, a subprocess"
RAW_EXEC = "raw: echo hi, docker exec"


@dataclass(frozen=True)
class Plan:
    starts: int
    runs: int
    figures: int


def plan(quick: bool) -> Plan:
    return Plan(3, 30, 10) if quick else Plan(8, 200, 20)


class _Http:
    """The service over HTTP, local backend, a warm pool of one."""

    def __init__(self, api: httpx.AsyncClient, sid: str) -> None:
        self.api, self.sid = api, sid
        self.handed: str | None = None
        self.lean: LeanHttp | None = None
        self.lean_execute = self.lean_invoke = b""

    async def execute(self) -> None:
        r = await self.api.post(f"/v1/sessions/{self.sid}/execute", json={"code": "1+1"})
        assert r.json()["results"][0]["text"] == "2", r.text

    async def execute_lean(self) -> None:
        assert self.lean is not None
        status, body = await self.lean.send(self.lean_execute)
        assert status == 200 and json.loads(body)["results"][0]["text"] == "2", body

    async def invoke_lean(self) -> None:
        assert self.lean is not None
        status, body = await self.lean.send(self.lean_invoke)
        assert status == 200 and "[result]\n2" in json.loads(body)["output"]["content"], body

    async def invoke(self) -> None:
        r = await self.api.post(
            "/v1/tools/code_interpreter/invoke",
            json={"arguments": {"code": "1+1", "session_id": self.sid}, "call_id": "b"},
        )
        assert "[result]\n2" in r.json()["output"]["content"], r.text

    async def pool_full(self) -> None:
        """The last hand-over's session gone, the pool full again and the host quiet (the
        refill over): untimed, before each sample beside a hand-over, the floor's too."""
        if self.handed is not None:
            await self.api.delete(f"/v1/sessions/{self.handed}")
            self.handed = None
        await first_chart.pool_full(self.api, "local")
        await quiet()

    async def hand_over(self) -> None:
        r = await self.api.post("/v1/sessions", json={})
        assert r.json()["from_pool"] is True, r.text
        self.handed = r.json()["id"]

    async def echo(self) -> None:
        r = await self.api.post(f"/v1/sessions/{self.sid}/commands", json={"argv": ["echo", "hi"]})
        assert r.json()["stdout"] == "hi\n", r.text


@contextlib.asynccontextmanager
async def _over_http(sessions: int) -> AsyncIterator[_Http]:
    settings = {"pool_size": "1", "max_sessions_per_key": str(sessions + 10)}
    async with (
        served(**settings) as url,
        httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        ) as api,
    ):
        http = _Http(api, "")
        await http.pool_full()
        http.sid = (await api.post("/v1/sessions", json={})).json()["id"]
        http.lean = await LeanHttp.connect(url)
        try:
            http.lean_execute = http.lean.request(
                f"/v1/sessions/{http.sid}/execute", {"code": "1+1"}, API_KEY
            )
            http.lean_invoke = http.lean.request(
                "/v1/tools/code_interpreter/invoke",
                {"arguments": {"code": "1+1", "session_id": http.sid}, "call_id": "b"},
                API_KEY,
            )
            yield http
        finally:
            await http.lean.close()


async def _cold(b: Backend, after: Untimed) -> None:
    sb = await b.create()
    after.later(sb.close)


async def _trivial(sb: Sandbox) -> None:
    assert (await sb.execute(workloads.TRIVIAL)).text == "2"


async def _figure(sb: Sandbox) -> None:
    ex = await sb.execute(workloads.FIGURE)
    assert ex.artifacts and ex.artifacts[0].data[:4] == b"\x89PNG"


async def _raw_figure(kc: Any) -> None:
    got = await raw.run(kc, workloads.FIGURE)
    assert got["png"] and got["png"][0][:4] == b"\x89PNG"


async def measure(p: Plan, backends: list[str]) -> dict[str, tuple[Sampled, str]]:
    """Each measure's samples and the name of its baseline."""
    out: dict[str, tuple[Sampled, str]] = {}
    async with contextlib.AsyncExitStack() as stack:
        walls = {}
        for name in backends:
            walls[name] = backend(name)
            stack.push_async_callback(walls[name].close)

        after = Untimed()
        settled = after.settle
        try:
            starts = await interleaved(
                {
                    RAW_START: Measure(partial(raw.start_untimed_stop, after), settled),
                    **{
                        f"{n}: cold session start": Measure(partial(_cold, b, after), settled)
                        for n, b in walls.items()
                    },
                },
                p.starts,
                batch=1,
                warmup=1,
            )
        finally:
            await after.run()
        out |= {name: (s, RAW_START) for name, s in starts.items()}

        km, kc = await raw.start()
        stack.push_async_callback(raw.stop, km, kc)
        await raw.run(kc, workloads.FIGURE_SETUP)
        boxes = {}
        for name, b in walls.items():
            boxes[name] = await stack.enter_async_context(await b.create())
            await boxes[name].execute(workloads.FIGURE_SETUP)
        http = await stack.enter_async_context(_over_http(p.starts * 2))
        trivial = await interleaved(
            {
                RAW_TRIVIAL: Measure(partial(raw.run, kc, workloads.TRIVIAL)),
                **{
                    f"{n}: 1+1 via Python API": Measure(partial(_trivial, sb))
                    for n, sb in boxes.items()
                },
                "service: 1+1 via HTTP execute": Measure(http.execute),
                "service: 1+1 via HTTP tool invoke": Measure(http.invoke),
                "service: 1+1 via HTTP execute, a lean client": Measure(http.execute_lean),
                "service: 1+1 via HTTP tool invoke, a lean client": Measure(http.invoke_lean),
            },
            p.runs,
        )
        out |= {name: (s, RAW_TRIVIAL) for name, s in trivial.items()}
        handover = await interleaved(
            {
                "service: warm-pool hand-over (HTTP)": Measure(http.hand_over, http.pool_full),
                RAW_TRIVIAL + " (beside the hand-over)": Measure(
                    partial(raw.run, kc, workloads.TRIVIAL), http.pool_full
                ),
            },
            p.starts * 2,
            batch=1,
            warmup=1,
        )
        out["service: warm-pool hand-over (HTTP)"] = (
            handover["service: warm-pool hand-over (HTTP)"],
            RAW_TRIVIAL + " (beside the hand-over)",
        )
        out[RAW_TRIVIAL + " (beside the hand-over)"] = (
            handover[RAW_TRIVIAL + " (beside the hand-over)"],
            RAW_TRIVIAL + " (beside the hand-over)",
        )
        figure = await interleaved(
            {
                RAW_FIGURE: Measure(partial(_raw_figure, kc)),
                **{
                    f"{n}: matplotlib figure, PNG in hand": Measure(partial(_figure, sb))
                    for n, sb in boxes.items()
                },
            },
            p.figures,
            batch=5,
        )
        out |= {name: (s, RAW_FIGURE) for name, s in figure.items()}

        echo = {
            RAW_ECHO: Measure(commands.subprocess_once),
            **{
                f"{n}: echo hi via Python API": Measure(partial(commands.sandbox_once, sb))
                for n, sb in boxes.items()
            },
            "service: echo hi via HTTP": Measure(http.echo),
        }
        if "docker" in boxes:
            exec_floor = await stack.enter_async_context(commands.docker_exec_floor())
            echo[RAW_EXEC] = Measure(exec_floor)
        e2b = await stack.enter_async_context(commands.e2b_sandbox(http.api.base_url))
        echo["service: echo hi via E2B SDK"] = Measure(e2b)
        echoed = await interleaved(echo, p.runs)
        out |= {name: (s, RAW_EXEC if name == RAW_EXEC else RAW_ECHO) for name, s in echoed.items()}
    return out
