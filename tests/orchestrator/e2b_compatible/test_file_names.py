"""E2B's filesystem service over a workspace whose names the sandboxed code chose."""

from __future__ import annotations

from e2b_code_interpreter import Sandbox


def test_list_dir_shows_a_name_that_is_not_utf8_escaped(sbx: Sandbox) -> None:
    made = sbx.run_code("open(b'caf\\xe9.txt', 'w').write('x'); open('ok.txt', 'w').write('y')")
    assert made.error is None, made.error
    for depth in (1, 2):
        names = {e.name for e in sbx.files.list("/workspace", depth=depth)}
        assert names == {"caf\\xe9.txt", "ok.txt"}
    assert sbx.files.exists("ok.txt")
