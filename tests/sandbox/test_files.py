"""Moving files in and out of a sandbox's workspace, and the paths that must be refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from code_interpreter_wire.errors import FileAccessError, FileTooLarge, InvalidPath
from sandbox import Sandbox


async def test_upload_list_download_remove(sandbox: Sandbox) -> None:
    info = await sandbox.upload("data/in.csv", b"a,b\n1,2\n")
    assert (info.path, info.type, info.size) == ("data/in.csv", "file", 8)
    ex = await sandbox.execute(
        "import pandas as pd\n"
        "df = pd.read_csv('data/in.csv'); df['c'] = df.a + df.b\n"
        "df.to_csv('data/out.csv', index=False)"
    )
    assert ex.ok, ex.error
    listing = await sandbox.list_files("data")
    assert [(f.path, f.type) for f in listing] == [
        ("data/in.csv", "file"),
        ("data/out.csv", "file"),
    ]
    assert listing[0].size == 8
    assert await sandbox.download("data/out.csv") == b"a,b,c\n1,2,3\n"
    everything = await sandbox.list_files(recursive=True)
    assert {f.path for f in everything} == {"data", "data/in.csv", "data/out.csv"}
    await sandbox.remove_file("data")
    assert await sandbox.list_files() == []


async def test_binary_round_trip_and_overwrite(sandbox: Sandbox) -> None:
    blob = bytes(range(256)) * 4096
    await sandbox.upload("blob.bin", blob)
    await sandbox.upload("blob.bin", blob[:10])  # overwrite truncates
    assert await sandbox.download("blob.bin") == blob[:10]
    ex = await sandbox.execute("open('blob.bin', 'ab').write(b'!')")  # the code owns it
    assert ex.ok, ex.error


@pytest.mark.parametrize(
    "path", ["../escape", "a/../../escape", "/etc/passwd", "a\x00b", "", "bad\nname", "\\abs"]
)
async def test_unsafe_paths_are_refused(sandbox: Sandbox, path: str) -> None:
    with pytest.raises(InvalidPath):
        await sandbox.upload(path, b"x")
    with pytest.raises(InvalidPath):
        await sandbox.download(path)


async def test_odd_but_valid_names_work(sandbox: Sandbox) -> None:
    name = "ünïcødé файл 数据 (1).txt"
    await sandbox.upload(name, b"ok")
    ex = await sandbox.execute(f"open({name!r}).read()")
    assert ex.text == "'ok'"
    assert await sandbox.download(name) == b"ok"


async def test_planted_symlinks_are_never_followed(sandbox: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host only")
    tmp_path.chmod(0o755)
    ex = await sandbox.execute(
        "import os\n"
        f"os.symlink({str(secret)!r}, 'file-link')\n"
        f"os.symlink({str(tmp_path)!r}, 'dir-link')\n"
        "os.symlink('/etc', 'etc-link')"
    )
    assert ex.ok, ex.error
    for path in ("file-link", "dir-link/host-secret.txt", "etc-link/passwd"):
        with pytest.raises(FileAccessError):
            await sandbox.download(path)
    for path in ("file-link", "dir-link/new.txt", "etc-link/evil"):
        with pytest.raises(FileAccessError):
            await sandbox.upload(path, b"overwritten")
    assert secret.read_text() == "host only"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host-secret.txt"]
    listing = {f.path: f.type for f in await sandbox.list_files()}
    assert listing == {"dir-link": "symlink", "etc-link": "symlink", "file-link": "symlink"}
    with pytest.raises(FileAccessError):
        await sandbox.list_files("dir-link")
    await sandbox.remove_file("dir-link")  # removes the link, not what it points at
    assert secret.exists()


async def test_fifo_and_size_limit(sandbox: Sandbox) -> None:
    ex = await sandbox.execute(
        "import os; os.mkfifo('pipe')\n"
        "f = open('sparse', 'wb'); f.seek(50 * 1024**2); f.write(b'x'); f.close()"
    )
    assert ex.ok, ex.error
    with pytest.raises(FileAccessError):
        await sandbox.download("pipe")  # never blocks on a FIFO
    with pytest.raises(FileTooLarge):
        await sandbox.download("sparse", max_bytes=1 << 20)
    with pytest.raises(FileAccessError):
        await sandbox.download("missing.txt")


async def test_deep_trees_are_listed_without_recursion_or_fd_growth(sandbox: Sandbox) -> None:
    ex = await sandbox.execute(
        "import os\np = 'deep'\nfor i in range(400):\n    p += f'/{i}'\nos.makedirs(p)\n"
        "open(p + '/leaf.txt', 'w').write('x')"
    )
    assert ex.ok, ex.error
    entries = await sandbox.list_files("deep", recursive=True)
    assert len(entries) == 401 and entries[-1].path.endswith("/399/leaf.txt")
