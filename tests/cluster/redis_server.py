"""A real `redis-server` for the cluster tests: on 127.0.0.1, a free port, its own directory, no
persistence, a password of its own (`requirepass`: the service refuses a Redis without one, so
the tests run as a deployment must); stopped (by its own pid) when the block ends."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server(directory: Path, *, password: str | None = None) -> Iterator[str]:
    """Start one; yield its URL with its password (redis://:PASSWORD@127.0.0.1:PORT/0).
    `password`: its password, else a new random one; "" starts it without one (for the tests
    of the refusal), its URL then without one too."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    password = secrets.token_hex(16) if password is None else password
    # Its configuration file is its stdin ("-"): on the command line, `ps` would show the
    # password to every user of the machine.
    config = f"requirepass {password}\n" if password else ""
    process = subprocess.Popen(
        [
            REDIS_SERVER, "-",
            "--bind", "127.0.0.1",
            "--port", str(port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(directory),
            "--protected-mode", "yes",
        ],
        stdin=subprocess.PIPE,
        stdout=(directory / "redis.log").open("wb"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert process.stdin is not None
    process.stdin.write(config.encode())
    process.stdin.close()
    url = f"redis://:{password}@127.0.0.1:{port}/0" if password else f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not start: {(directory / 'redis.log').read_text()}"
                    ) from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
