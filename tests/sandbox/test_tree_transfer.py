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


def test_owners_and_modes_the_writer_may_not_set_are_kept_beside_the_tree_for_its_next_reader(
    tmp_path: Path,
) -> None:
    """A writer that is not root keeps owners and modes beside its copy, which stays its own to
    read and delete (a file of mode 0, a directory of 0o555), and the next reader sends the
    true ones."""
    source = tmp_path / "source"
    (source / "shut").mkdir(parents=True)
    (source / "shut" / "file").write_text("x")
    (source / "shut" / "file").chmod(0o000)
    (source / "shut").chmod(0o555)
    if os.geteuid() == 0:
        os.chown(source / "shut" / "file", 1234, 5678)
    expected, directory = (source / "shut" / "file").stat(), (source / "shut").stat()
    carried(source, tmp_path / "store", set_owners=False)
    store = tmp_path / "store"
    assert (store / OWNERS_FILE).is_file()
    assert (store / "shut" / "file").stat().st_mode & 0o600 == 0o600
    assert (store / "shut").stat().st_mode & 0o700 == 0o700
    sent = {
        e.path: (e.uid, e.gid, e.mode)
        for batch in read_tree(store, max_bytes=1 << 20)
        for e in batch
        if e.kind != "data"
    }  # the sidecar itself is not sent
    assert sent == {
        "shut": (directory.st_uid, directory.st_gid, 0o555),
        "shut/file": (expected.st_uid, expected.st_gid, 0o000),
    }


def test_a_name_that_is_not_utf8_is_carried_as_it_is(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    odd = os.fsdecode(b"caf\xe9.txt")  # Latin-1, as an old archive unpacks it
    (source / odd).write_text("x")
    carried(source, tmp_path / "dest")
    assert os.listdir(os.fsencode(tmp_path / "dest")) == [b"caf\xe9.txt"]


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
