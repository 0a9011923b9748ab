"""Which store URLs carry a password (redis-py's forms), and how an error shows one: never with
its user, password or query."""

from __future__ import annotations

import pytest

from orchestrator.state_store.redis_auth import (
    UnauthenticatedStore,
    check_store_url,
    has_password,
    shown_url,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@redis:6379/1",
        "redis://cir:s3cret@redis:6379/1",
        "rediss://:s3cret@redis.example:6380/0",
        "rediss://cir:s3cret@redis.example:6380/0",
        "redis://redis:6379/1?password=s3cret",
        "unix:///run/redis/redis.sock?db=1&password=s3cret",
        "unix://cir:s3cret@/run/redis/redis.sock?db=1",
    ],
)
def test_a_url_with_a_password_passes(url: str) -> None:
    assert has_password(url)
    check_store_url(url, allow_unauthenticated=False)
    assert "s3cret" not in shown_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://redis:6379/1",
        "redis://cir@redis:6379/1",  # a user with no password: nothing is proved
        "redis://:@redis:6379/1",
        "rediss://redis.example:6380/0",
        "redis://redis:6379/1?password=",
        "unix:///run/redis/redis.sock?db=1",
    ],
)
def test_a_url_without_one_is_refused_unless_allowed(url: str) -> None:
    assert not has_password(url)
    with pytest.raises(UnauthenticatedStore, match="has no password") as caught:
        check_store_url(url, allow_unauthenticated=False)
    assert "CODE_INTERPRETER_STORE_ALLOW_UNAUTHENTICATED=true" in str(caught.value)
    assert "redis://:PASSWORD@HOST:PORT/DB" in str(caught.value)
    check_store_url(url, allow_unauthenticated=True)


def test_the_settings_refuse_it_before_anything_connects() -> None:
    from pydantic import ValidationError

    from orchestrator.config import Settings

    with pytest.raises(ValidationError, match="has no password"):
        Settings(api_keys=["k"], store_url="redis://127.0.0.1:1/0")
    allowed = Settings(
        api_keys=["k"], store_url="redis://127.0.0.1:1/0", store_allow_unauthenticated=True
    )
    assert allowed.cluster_mode
