"""A kernel's container as the driver sees it (a `KernelProcess`), and how its death is learnt:
from the engine's event stream, one for every sandbox of a backend, never by polling.

The labels every container of ours carries live here too: they are how the stream, the clean-up
of orphans and a sandbox's own close find its containers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import docker
from docker.errors import APIError, DockerException, NotFound
from requests.exceptions import ReadTimeout, RequestException

from sandbox.kernel.process import KernelExit

log = logging.getLogger(__name__)

LABEL_SANDBOX = "code-interpreter.sandbox"
LABEL_ORCHESTRATOR = "code-interpreter.orchestrator"
LABEL_OWNER = "code-interpreter.owner"  # prefix of the owner process's labels (pid, start...)
# An OOM kill reported this shortly before a container died killed its kernel (measured: the
# report comes ~40 ms before the death); one reported earlier killed a command beside it.
OOM_BEFORE_DEATH_S = 5.0
# Reports (OOM kills, kill requests) of containers nobody watches (gone while the event stream
# was down, or never ours to watch) are dropped once this old; and at most this many are kept.
REPORT_KEPT_S = 60.0
MAX_REPORTS = 10_000
_REMOVAL_ATTEMPTS = 5
# A removal the engine has not finished when its call's read timeout ends is still under way
# (killing a gVisor sandbox full of a fork bomb's processes takes minutes on a loaded host):
# it is waited for up to this long before the container is given up as left behind.
REMOVAL_WAIT_S = 300.0


async def remove_container(container: Any) -> bool:
    """Remove a container and every process in it; whether it is gone.

    A busy engine may fail a removal (its root filesystem still busy, a removal already under
    way): it is asked again a few times. A call that times out (the engine is still killing
    what the container holds) is not a failure: the container is watched until it is gone,
    within REMOVAL_WAIT_S, and asked again meanwhile. Never raises for the engine's sake: a
    sandbox being closed must close."""
    deadline = time.monotonic() + REMOVAL_WAIT_S
    failures, delay = 0, 0.5
    while True:
        try:
            await asyncio.to_thread(container.remove, force=True)
            return True
        except NotFound:
            return True
        except ReadTimeout as exc:  # the engine did not answer in time: still under way
            if await _gone(container):
                return True
            if time.monotonic() >= deadline:
                log.warning(
                    "container %s was still being removed after %.0f s: %s",
                    container.id,
                    REMOVAL_WAIT_S,
                    exc,
                )
                return False
        except (APIError, DockerException, RequestException) as exc:  # no engine to ask
            failures += 1
            if failures >= _REMOVAL_ATTEMPTS:
                log.warning("the engine did not remove container %s: %s", container.id, exc)
                return False
        await asyncio.sleep(delay)
        delay = min(delay * 2, 10.0)


async def _gone(container: Any) -> bool:
    try:
        await asyncio.to_thread(container.reload)
    except NotFound:
        return True
    except (APIError, RequestException, DockerException):
        pass
    return False


class KernelContainer:
    """A kernel's container, as a KernelProcess."""

    def __init__(self, container: Any, exited: asyncio.Future[KernelExit]) -> None:
        self.container = container
        self.exited = exited
        self.logs = ""

    async def wait(self) -> KernelExit:
        return await asyncio.shield(self.exited)

    async def kill(self) -> None:
        await remove_container(self.container)
        if not self.exited.done():
            self.exited.set_result(KernelExit("was killed by the orchestrator", None, 9))

    def diagnostics(self) -> str:
        return self.logs


class DeathWatch:
    """Follows the engine's event stream and tells each kernel's future when its container dies.

    One stream serves every sandbox of the backend, so nothing polls. Subscribed before any
    container starts, so no death can slip by between start and watch. A death is blamed on
    memory only when the engine reported an OOM kill in the container just before it (an
    earlier one killed a command, not the kernel), and on the engine when it was asked to kill
    the container (`docker kill`); any other signal came from inside the sandbox.
    """

    def __init__(self, client: docker.DockerClient, orchestrator_id: str) -> None:
        self.client = client
        self.filters = {
            "type": "container",
            "event": ["die", "oom", "kill"],
            "label": [f"{LABEL_ORCHESTRATOR}={orchestrator_id}"],
        }
        self._watched: dict[str, tuple[asyncio.AbstractEventLoop, KernelContainer]] = {}
        # Container id: the engine's time (ns) of its last OOM kill, or of a request to kill it.
        self._oom: dict[str, int] = {}
        self._killed: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._stream = self.client.events(decode=True, filters=self.filters)
        self._thread = threading.Thread(target=self._run, name="docker-deaths", daemon=True)
        self._thread.start()

    def watch(self, container_id: str, process: KernelContainer) -> None:
        with self._lock:
            self._watched[container_id] = (asyncio.get_running_loop(), process)

    def forget(self, container_id: str) -> None:
        """Stop watching a container that never started (no death comes for it)."""
        with self._lock:
            self._watched.pop(container_id, None)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):
            self._stream.close()

    def _run(self) -> None:
        while not self._closed:
            try:
                for event in self._stream:
                    self._handle(event)
            except Exception as exc:  # the stream broke: reconnect, then look for missed deaths
                if self._closed:
                    return
                log.warning("docker event stream broke (%s); reconnecting", exc)
            if self._closed:
                return
            try:
                self._stream = self.client.events(decode=True, filters=self.filters)
            except DockerException:
                threading.Event().wait(1.0)
                continue
            self._recheck()

    def _handle(self, event: dict[str, Any]) -> None:
        container_id = event.get("id", "")
        action = event.get("status") or event.get("Action")
        # The engine's own time of the event: when it happened, not when it was read.
        at = int(event.get("timeNano") or time.time_ns())
        if action in ("oom", "kill"):
            reports = self._oom if action == "oom" else self._killed
            reports.pop(container_id, None)  # the latest last: in order of arrival
            reports[container_id] = at
            self._forget_stale(reports, at)
            return
        if action != "die":
            return
        code = int(event.get("Actor", {}).get("Attributes", {}).get("exitCode", -1))
        self._died(container_id, code, at)

    def _died(self, container_id: str, code: int, died_at: int | None) -> None:
        """Tell the kernel of `container_id` how it died (`died_at`: the engine's time of the
        death, None when it was found dead rather than told)."""
        with self._lock:
            entry = self._watched.pop(container_id, None)
        oom_at = self._oom.pop(container_id, None)
        killed = self._killed.pop(container_id, None) is not None
        if entry is None:
            return
        loop, process = entry
        oom: bool | None = None  # no evidence yet
        if oom_at is not None and died_at is not None:
            oom = died_at - oom_at < OOM_BEFORE_DEATH_S * 1e9
        try:
            container = self.client.containers.get(container_id)
            if oom is None:  # no report came (the stream may have missed it): the engine's flag
                oom = bool(container.attrs["State"].get("OOMKilled"))
            process.logs = container.logs(tail=60).decode(errors="replace")
        except (NotFound, APIError):
            pass  # gone, or the engine would not say: nothing tells whether memory did it
        death = KernelExit.from_returncode(code, out_of_memory=oom, killed_from_outside=killed)
        loop.call_soon_threadsafe(_resolve, process.exited, death)

    def _forget_stale(self, reports: dict[str, int], now: int) -> None:
        """Drop the reports of containers nobody watches once old, and the oldest past the
        cap. A watched container's stay until it dies: its OOM kill long ago, found missing,
        would leave only the engine's OOM flag, which stays set for the container's life."""
        if not reports or now - next(iter(reports.values())) <= REPORT_KEPT_S * 1e9:
            stale = []  # in order of arrival: when the oldest is not old, none is
        else:
            with self._lock:
                stale = [
                    container_id
                    for container_id, at in reports.items()
                    if container_id not in self._watched and now - at > REPORT_KEPT_S * 1e9
                ]
        for container_id in stale:
            del reports[container_id]
        while len(reports) > MAX_REPORTS:
            del reports[next(iter(reports))]

    def _recheck(self) -> None:
        with self._lock:
            watched = list(self._watched)
        for container_id in watched:
            try:
                state = self.client.containers.get(container_id).attrs["State"]
            except NotFound:
                self._died(container_id, 137, None)  # gone: how it died is lost with it
                continue
            except APIError:
                continue
            if not state.get("Running"):
                self._died(container_id, int(state.get("ExitCode", -1)), None)


def _resolve(future: asyncio.Future[KernelExit], value: KernelExit) -> None:
    if not future.done():
        future.set_result(value)
