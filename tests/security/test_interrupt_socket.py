"""Review (issue 16): the host's poke at a supervisor's interrupt socket, on its own.

tests/security/test_language_kernels.py plants a link in R's kernel directory, but once the
directory is sealed (root, Docker) the planting itself fails, so `poke_interrupt_socket`'s own
defences (no link followed, a socket or nothing) are never reached there. These reach them
directly.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.kernel.generation import poke_interrupt_socket


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[Path, socket.socket]]:
    path = tmp_path / "host.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    server.settimeout(0.2)
    try:
        yield path, server
    finally:
        server.close()


def test_a_socket_is_poked_with_one_byte(listener: tuple[Path, socket.socket]) -> None:
    path, server = listener
    poke_interrupt_socket(path)
    conn, _ = server.accept()
    with conn:
        assert conn.recv(10) == b"\x03"


def test_a_link_to_a_socket_is_never_followed(
    listener: tuple[Path, socket.socket], tmp_path: Path
) -> None:
    path, server = listener
    link = tmp_path / "interrupt"
    link.symlink_to(path)
    poke_interrupt_socket(link)
    with pytest.raises(TimeoutError):
        server.accept()


def test_a_fifo_in_its_place_neither_blocks_nor_is_written(tmp_path: Path) -> None:
    fifo = tmp_path / "interrupt"
    os.mkfifo(fifo)
    poke_interrupt_socket(fifo)  # returns: O_PATH opens a FIFO without waiting for a writer
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert os.read(reader, 10) == b""
    finally:
        os.close(reader)
