"""Keep a Ray node on loopback when it is told to be there.

Ray rewrites a node address of 127.0.0.1 (or `localhost`) into the machine's outward address
(`ray._private.services.resolve_ip_for_localhost`), so `ray start --node-ip-address=127.0.0.1`
and `ray.init(_node_ip_address="127.0.0.1")` end up advertising, and dialling, the machine's
network address. A cluster that lives on one machine (tests, a laptop) must stay on loopback:
`keep_loopback()` makes an explicit loopback address stay what it is. Any other address goes
through Ray's own resolution unchanged.

`python -m sandbox.backends.ray_cluster.loopback start ...` is `ray start ...` with that rule.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

LOOPBACK = "127.0.0.1"
_patched = False


def keep_loopback() -> None:
    """Make Ray keep an explicit 127.0.0.1 as the node address in this process. Idempotent."""
    global _patched
    if _patched:
        return
    from ray._private import services

    resolve: Callable[[str], str] = services.resolve_ip_for_localhost

    def keep(host: str) -> str:
        return host if host == LOOPBACK else resolve(host)

    services.resolve_ip_for_localhost = keep
    _patched = True


def main() -> None:
    """`ray <args>` with loopback kept (for `ray start --node-ip-address=127.0.0.1`)."""
    keep_loopback()
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *sys.argv[1:]]
    ray_main()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
