"""A directory tree carried as batches (sandbox/tree_transfer.py): whole and as it was, never
through a link, never outside its destination, and within its caps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandbox.tree_transfer import OWNERS_FILE, TreeEntry, TreeRefused, TreeWriter, read_tree

pytestmark = pytest.mark.unit


def carried(source: Path, dest: Path, **writer: object) -> TreeWriter:
    made = TreeWriter(dest, max_bytes=1 << 30, **writer)  # type: ignore[arg-type]
    for batch in read_tree(source, max_bytes=1 << 30, batch_bytes=1000):
        made.write(batch)
    made.finish()
    return made


def test_a_tree_arrives_whole_with_its_links_modes_and_times(tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "dir" / "deeper").mkdir(parents=True)
    (source / "dir" / "deeper" / "big.bin").write_bytes(os.urandom(5000))  # several batches
    (source / ".hidden").write_text("dot")
    (source / "empty").write_bytes(b"")
    (source / "link").symlink_to("/etc/passwd")  # a link is carried as a link, unread
    os.mkfifo(source / "fifo")  # left out
    (source / "dir" / "script").write_text("#!/bin/sh\n")
    (source / "dir" / "script").chmod(0o751)
    os.utime(source / "dir" / "script", ns=(1_000_000_000, 2_000_000_000))
    (source / "dir" / "deeper").chmod(0o500)  # filled before it is made read-only
    carried(source, tmp_path / "dest")
    dest = tmp_path / "dest"
    assert (dest / "dir" / "deeper" / "big.bin").read_bytes() == (
        source / "dir" / "deeper" / "big.bin"
    ).read_bytes()
    assert (dest / ".hidden").read_text() == "dot"
    assert (dest / "empty").read_bytes() == b""
    assert os.readlink(dest / "link") == "/etc/passwd"
    assert not (dest / "fifo").exists()
    script = (dest / "dir" / "script").stat()
    assert (script.st_mode & 0o7777, script.st_mtime_ns) == (0o751, 2_000_000_000)
    assert (dest / "dir" / "deeper").stat().st_mode & 0o7777 == 0o500


def test_owners_the_writer_may_not_set_are_kept_beside_the_tree_for_its_next_reader(
    tmp_path: Path,
) -> None:
    source = tmp_path / "source"
    source.mkdir()
    (source / "file").write_text("x")
    if os.geteuid() == 0:
        os.chown(source / "file", 1234, 5678)
    expected = (source / "file").stat()
    carried(source, tmp_path / "store", set_owners=False)
    assert (tmp_path / "store" / OWNERS_FILE).is_file()
    owners = {
        e.path: (e.uid, e.gid)
        for b in read_tree(tmp_path / "store", max_bytes=1 << 20)
        for e in b
        if e.kind != "data"
    }
    assert owners == {"file": (expected.st_uid, expected.st_gid)}  # the sidecar itself is not sent


@pytest.mark.parametrize(
    "entries",
    [
        [TreeEntry("file", "../escaped")],
        [TreeEntry("file", "/etc/escaped")],
        [TreeEntry("file", "a/./b")],
        [TreeEntry("file", "")],
        [TreeEntry("file", OWNERS_FILE)],
        [TreeEntry("file", "missing-dir/file")],
        # through a link it just made: the link is never a directory of the tree
        [TreeEntry("link", "out", target="/tmp"), TreeEntry("file", "out/escaped")],
        # a file, then the same name again: never over an existing name
        [TreeEntry("file", "twice"), TreeEntry("file", "twice")],
        [TreeEntry("data", data=b"no file before it")],
    ],
)
def test_a_hostile_stream_is_refused_and_touches_nothing_outside(
    tmp_path: Path, entries: list[TreeEntry]
) -> None:
    outside = set(tmp_path.parent.iterdir())
    writer = TreeWriter(tmp_path / "dest", max_bytes=1 << 20)
    with pytest.raises((TreeRefused, FileExistsError)):
        writer.write(entries)
    writer.abort()
    assert not (tmp_path / "dest").exists()
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/escaped").exists()
    assert set(tmp_path.parent.iterdir()) == outside


def test_caps_hold_on_both_ends(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    (source / "big").write_bytes(b"x" * 10_000)
    with pytest.raises(TreeRefused, match="over 9999 bytes"):
        list(read_tree(source, max_bytes=9999))
    writer = TreeWriter(tmp_path / "dest", max_bytes=100)
    with pytest.raises(TreeRefused, match="over 100 bytes"):
        writer.write([TreeEntry("file", "big"), TreeEntry("data", data=b"x" * 101)])
    writer.abort()
    assert not (tmp_path / "dest").exists()
