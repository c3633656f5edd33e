"""The redis+sentinel:// URL: what it names, what a malformed one says, and its masked form."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.redis_address import SentinelAddress, parse_sentinel_url, public
from shared.settings import Settings


def test_a_sentinel_url_names_the_sentinels_the_primary_and_the_credentials() -> None:
    address = parse_sentinel_url(
        "rediss+sentinel://app:s%40cret@10.0.0.1:26380,sentinel-b,[::1]:5000/cache/3"
        "?sentinel_password=sp")
    assert address == SentinelAddress(
        sentinels=(("10.0.0.1", 26380), ("sentinel-b", 26379), ("::1", 5000)), master="cache",
        db=3, username="app", password="s@cret", sentinel_password="sp", tls=True)
    assert parse_sentinel_url("redis+sentinel://h:1/m") == SentinelAddress(
        sentinels=(("h", 1),), master="m")


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel:///mymaster", "at least one Sentinel"),
    ("redis+sentinel://h:26379", "names the primary"),
    ("redis+sentinel://h:26379/m/zero", "is a number"),
    ("redis+sentinel://h:port/m", "not a host:port"),
    ("redis+sentinel://h/m?sentinel_pasword=x", "unknown Sentinel URL option"),
])
def test_a_malformed_sentinel_url_stops_the_settings(url: str, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        Settings(redis_url=url)


def test_sentinel_and_cluster_do_not_mix() -> None:
    with pytest.raises(ValidationError, match="not a Cluster"):
        Settings(redis_url="redis+sentinel://h/m", redis_cluster=True)


def test_public_masks_every_password() -> None:
    assert public("redis+sentinel://u:pw@h1:1,h2/m/0?sentinel_password=x&sentinel_username=s") \
        == "redis+sentinel://u:***@h1:1,h2/m/0?sentinel_password=***&sentinel_username=s"
    assert public("redis://:pw@host:6380/1") == "redis://:***@host:6380/1"
    assert public("redis+sentinel://h1/m") == "redis+sentinel://h1/m"
