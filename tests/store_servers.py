"""Tests that need a store server skip with the one line `cache.tiers.servers.unavailable` gives (a binary not
installed, or installed but missing a system library), never by timing out on a server that cannot start."""

import pytest

from cache.tiers.servers import unavailable


def require_server(kind: str, also: str = "") -> None:
  """Skip the calling test unless `kind` ("redis" or "mooncake") can start here; `also` says what did pass."""
  why = unavailable(kind)
  if why:
    pytest.skip(f"{why}{': ' + also if also else ''}")
