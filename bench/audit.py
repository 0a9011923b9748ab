"""What the audit log costs an execution: `1+1` over HTTP execute on a service with the log on
beside one with it off, both running in the same run, their samples taken in turns
(bench/interleave.py) so that whatever else the machine does falls on both alike."""

from __future__ import annotations

import asyncio
import time
from functools import partial

import httpx

from bench.interleave import Measure, Sampled, interleaved
from bench.served import API_KEY, served


async def on_and_off(runs: int) -> dict[str, Sampled]:
    """`1+1` executes on each: {"on": ..., "off": ...}, taken in turns."""
    async with (
        served(audit_enabled="true") as on_url,
        served(audit_enabled="false") as off_url,
        httpx.AsyncClient(base_url=on_url, headers=_auth(), timeout=60) as on,
        httpx.AsyncClient(base_url=off_url, headers=_auth(), timeout=60) as off,
    ):
        sessions = {
            name: (client, (await client.post("/v1/sessions", json={})).json()["id"])
            for name, client in (("on", on), ("off", off))
        }

        async def execute(client: httpx.AsyncClient, sid: str) -> None:
            r = await client.post(f"/v1/sessions/{sid}/execute", json={"code": "1+1"})
            assert r.json()["results"][0]["text"] == "2", r.text

        samples = await interleaved(
            {name: Measure(partial(execute, *pair)) for name, pair in sessions.items()},
            runs,
            warmup=5,
        )
        # The log is written behind the answers: its last events may take a moment to land.
        deadline = time.monotonic() + 30
        while True:
            query: dict[str, str | int] = {"kind": "execution", "limit": 1000}
            recorded = (await on.get("/v1/audit", params=query)).json()["events"]
            if len(recorded) >= min(runs, 1000):
                break
            assert time.monotonic() < deadline, f"the log on recorded {len(recorded)} executions"
            await asyncio.sleep(0.1)
        for client, sid in sessions.values():
            await client.delete(f"/v1/sessions/{sid}")
        return samples


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}
