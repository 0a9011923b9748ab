"""The Ray cluster as one process joins it, shared by every RayBackend of the process: joined
once (with the join policy's checks), left when the last backend lets go, and SIGTERM given
back to the process after Ray took it."""

from __future__ import annotations

import logging
import os
import signal
import threading

import ray

from code_interpreter_wire.errors import BackendUnavailable
from sandbox.backends.ray_cluster.config import RayBackendConfig
from sandbox.backends.ray_cluster.join_policy import check_join
from sandbox.backends.ray_cluster.loopback import LOOPBACK, keep_loopback

log = logging.getLogger(__name__)

_joined_lock = threading.Lock()
_joined = 0  # RayBackends of this process using the connection
_joined_by_us = False  # whether ray.init was ours (else: the process's, left alone)


def join_cluster(config: RayBackendConfig) -> None:
    global _joined, _joined_by_us
    with _joined_lock:
        if not ray.is_initialized():
            address = config.address or os.environ.get("RAY_ADDRESS") or "auto"
            check_join(address, os.environ, allow_unauthenticated=config.allow_unauthenticated)
            if config.node_ip == LOOPBACK:
                keep_loopback()
            try:
                ray.init(
                    address=address,
                    _node_ip_address=config.node_ip,
                    namespace=config.namespace,
                    log_to_driver=False,
                    configure_logging=False,
                )
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise BackendUnavailable(
                    f"no Ray cluster answers at {address!r} ({exc}); start one (`ray start "
                    "--head`) or give its address (--ray-address / RAY_ADDRESS)"
                ) from None
            _joined_by_us = True
        _joined += 1


_sigterm_warned = False


def give_back_sigterm() -> None:
    """Ray's core worker, as it starts, installs its crash handler for SIGTERM too: it takes the
    signal for a crash, prints a stack and arms an alarm that aborts the process (SIGABRT) 3 s
    later, so a replica told to stop (a rolling update) was aborted in the middle of its
    graceful shutdown. The process's own handler (uvicorn's, or Python's default) is given the
    signal back; Ray's handler still reports real crashes (SIGSEGV, SIGABRT...). Ray's shutdown
    resets SIGTERM to the default action behind Python's back: given back again then. Only the
    main thread may set handlers: elsewhere, a warning."""
    if threading.current_thread() is not threading.main_thread():
        global _sigterm_warned
        if not _sigterm_warned:
            _sigterm_warned = True
            log.warning(
                "SIGTERM cannot be given back to this process's own handler from a loop off "
                "the main thread: Ray's crash handler or its default action keeps it; set "
                "RAY_DISABLE_FAILURE_SIGNAL_HANDLER=1 before importing ray to keep it yours"
            )
        return
    handler = signal.getsignal(signal.SIGTERM)
    if handler is not None:  # None: a handler not set from Python, left alone
        signal.signal(signal.SIGTERM, handler)


def leave_cluster() -> None:
    global _joined, _joined_by_us
    with _joined_lock:
        _joined = max(0, _joined - 1)
        if _joined == 0 and _joined_by_us:
            _joined_by_us = False
            ray.shutdown()
