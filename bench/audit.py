"""What the audit log costs an execution: `1+1` over HTTP execute on a service with the log on
beside one with it off, both running in the same run, their samples taken in turn (on, off, on,
off...) so that whatever else the machine does falls on both alike."""

from __future__ import annotations

import time

import httpx

from bench.served import API_KEY, served


async def on_and_off(runs: int, warmup: int = 5) -> dict[str, list[float]]:
    """Seconds per `1+1` execute: {"on": [...], "off": [...]}."""
    async with (
        served(audit_enabled="true") as on_url,
        served(audit_enabled="false") as off_url,
        httpx.AsyncClient(base_url=on_url, headers=_auth(), timeout=60) as on,
        httpx.AsyncClient(base_url=off_url, headers=_auth(), timeout=60) as off,
    ):
        sessions = [
            (client, (await client.post("/v1/sessions", json={})).json()["id"])
            for client in (on, off)
        ]
        samples: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(warmup + runs):
            for name, (client, sid) in zip(("on", "off"), sessions, strict=True):
                t = time.perf_counter()
                r = await client.post(f"/v1/sessions/{sid}/execute", json={"code": "1+1"})
                took = time.perf_counter() - t
                assert r.json()["results"][0]["text"] == "2", r.text
                if i >= warmup:
                    samples[name].append(took)
        recorded = (await on.get("/v1/audit", params={"kind": "execution", "limit": 1000})).json()
        assert len(recorded["events"]) >= min(runs, 1000), "the log on recorded no executions"
        for client, sid in sessions:
            await client.delete(f"/v1/sessions/{sid}")
        return samples


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}
