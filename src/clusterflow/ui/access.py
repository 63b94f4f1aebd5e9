"""Who may see and do what on the dashboard: the token, the host, the bind address.

The rules (docs/dashboard.md):

* bound to a loopback address, pages, figures and log tails need no token (they never
  leave the host); bound to any other address, every request needs it;
* an action (stopping a cluster) needs the token everywhere, loopback included, since
  any local program or web page could otherwise post to it;
* on loopback, a request whose ``Host`` header names anything but a loopback address is
  refused, so a web page that rebinds its own DNS name to 127.0.0.1 cannot read it.

The token arrives as ``Authorization: Bearer``, as ``?token=`` (the URL that
``clusterflow ui`` prints; the answer then sets it as a same-site cookie, so the page's
own requests carry it) or as that cookie. Comparisons take constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from clusterflow.errors import ConfigError

__all__ = ["COOKIE", "Access", "is_loopback", "new_token"]

COOKIE: Final = "clusterflow_ui_token"
LOOPBACK_NAMES: Final = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def new_token() -> str:
    """A fresh token: 32 bytes of randomness, URL-safe (it is printed inside a URL)."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only reaches this machine."""
    name = host.strip().lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host part of a ``Host`` header (``127.0.0.1:8265``, ``[::1]:8265``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True, slots=True)
class Access:
    """The dashboard's policy for one bind address and token."""

    bind_host: str
    """The address the server listens on."""
    token: str
    """The secret every action (and, off loopback, every request) must carry."""

    def __post_init__(self) -> None:
        if len(self.token) < 16:
            raise ConfigError("the dashboard's token must be at least 16 characters long")

    @property
    def loopback(self) -> bool:
        return is_loopback(self.bind_host)

    def presented(self, headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
        """The token a request carries, wherever it put it; None if it has none."""
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        if "token" in query:
            return query["token"]
        cookies = headers.get("cookie", "")
        for part in cookies.split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE:
                return value
        return None

    def valid(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.token.encode())

    def host_allowed(self, host_header: str | None) -> bool:
        """On loopback, only loopback names in ``Host`` (no DNS rebinding); else any."""
        if not self.loopback:
            return True
        return host_header is not None and is_loopback(_host_name(host_header))

    def may_read(self, token: str | None) -> bool:
        """Pages, figures, log tails: free on loopback, token-only elsewhere."""
        return self.loopback or self.valid(token)

    def may_act(self, token: str | None) -> bool:
        """Stopping a cluster: always the token."""
        return self.valid(token)
