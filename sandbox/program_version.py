"""What a host program says it is (`PROGRAM --version`, its first line), asked once per binary:
what a saved machine must have been saved by to be restored here (runsc, QEMU)."""

from __future__ import annotations

import asyncio
import os

_versions: dict[tuple[str, int, int], str] = {}


async def program_version(program: str) -> str:
    """Its first line of `--version`; asked again only of a new binary at that path."""
    st = os.stat(program)
    key = (program, st.st_ino, st.st_mtime_ns)
    if key not in _versions:
        process = await asyncio.create_subprocess_exec(
            program, "--version", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
        out, _ = await process.communicate()
        _versions[key] = out.decode(errors="replace").splitlines()[0].strip() if out else "unknown"
    return _versions[key]
