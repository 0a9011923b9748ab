"""The kept outputs (whole executions and their images) stay within a quota per session and one
for the whole service: the oldest are evicted, and asking for one says so."""

from __future__ import annotations

import base64
import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.orchestrator.service.conftest import KEY_A, KEY_B, Server, leftovers, make_server

PER_SESSION = 2 << 20
TOTAL = 3 << 20
PRINT_HALF_MB = "print('x' * 500_000)"
PLOT = (
    "import matplotlib.pyplot as plt, numpy as np\n"
    "plt.imshow(np.random.default_rng({seed}).random((200, 200))); plt.show()"
)


@pytest.fixture(scope="module")
def quota_server() -> Iterator[Server]:
    server = make_server(
        outputs_max_bytes_per_session=PER_SESSION,
        outputs_max_bytes_total=TOTAL,
        backends="local",
        default_backend="local",
    )
    server.start()
    yield server
    server.stop()
    assert leftovers(server) == []
    shutil.rmtree(server.state_dir.parent, ignore_errors=True)


def kept_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(api: httpx.Client, sid: str, code: str) -> dict[str, object]:
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code})
    assert r.status_code == 200, r.text
    body: dict[str, object] = r.json()
    assert body["status"] == "ok", body
    return body


def test_a_session_outputting_far_more_than_its_quota_stays_under_it(quota_server: Server) -> None:
    store = quota_server.state_dir / "outputs"
    with quota_server.client(KEY_A) as api:
        sid = api.post("/v1/sessions", json={}).json()["id"]
        first = run(api, sid, PLOT.format(seed=0))
        png = next(r["png"] for r in first["results"] if r.get("png"))  # type: ignore[attr-defined]
        artifact = hashlib.sha256(base64.b64decode(png)).hexdigest()[:24]  # its content id
        assert api.get(f"/v1/sessions/{sid}/artifacts/{artifact}").status_code == 200
        ids = [run(api, sid, PRINT_HALF_MB)["execution_id"] for _ in range(20)]  # 10 MB
        assert kept_bytes(store / sid) <= PER_SESSION
        newest = api.get(f"/v1/sessions/{sid}/executions/{ids[-1]}")
        assert newest.status_code == 200 and len(newest.json()["stdout"]) == 500_001
        for url in (f"executions/{ids[0]}", f"executions/{ids[0]}/stdout", f"artifacts/{artifact}"):
            gone = api.get(f"/v1/sessions/{sid}/{url}")
            assert gone.status_code == 410, (url, gone.text)
            error = gone.json()["error"]
            assert error["type"] == "OutputEvicted"
            assert "quota" in error["message"] and "run the code again" in error["message"]
        never = api.get(f"/v1/sessions/{sid}/executions/e-0123456789abcdef")
        assert never.status_code == 404


def test_all_sessions_together_stay_under_the_service_quota(quota_server: Server) -> None:
    store = quota_server.state_dir / "outputs"
    with quota_server.client(KEY_A) as a, quota_server.client(KEY_B) as b:
        sid_a = a.post("/v1/sessions", json={}).json()["id"]
        sid_b = b.post("/v1/sessions", json={}).json()["id"]
        old_a = run(a, sid_a, PRINT_HALF_MB)["execution_id"]
        for _ in range(3):
            run(a, sid_a, PRINT_HALF_MB)
        for _ in range(4):  # B's outputs push out A's oldest, never B's newest
            newest_b = run(b, sid_b, PRINT_HALF_MB)["execution_id"]
        assert kept_bytes(store) <= TOTAL
        assert kept_bytes(store / sid_b) <= PER_SESSION
        assert a.get(f"/v1/sessions/{sid_a}/executions/{old_a}").status_code == 410
        assert b.get(f"/v1/sessions/{sid_b}/executions/{newest_b}").status_code == 200
        for api, sid in ((a, sid_a), (b, sid_b)):
            assert api.delete(f"/v1/sessions/{sid}").status_code == 204
            assert not (store / sid).exists()
