"""Per-cluster credentials, checked by ZeroMQ's ZAP handler when a peer connects.

One random 32-byte secret per cluster yields both mechanisms' credentials:

* ``plain`` (the default on loopback): the peer presents a password derived from the
  secret. Authenticated, not encrypted: loopback traffic never leaves the host, and
  CURVE's encryption halves bulk throughput (docs/architecture.md section 4).
* ``curve`` (the default beyond loopback): a CURVE key pair derived from the secret.
  Every task holds the same pair; a server admits only clients presenting that public
  key, so a peer without the secret cannot complete the handshake, and all traffic is
  encrypted.

ZAP is per ZeroMQ context, so one authenticator thread serves every server socket of a
process; each secret gets its own ZAP domain, so servers of different clusters can live
in one process (tests, a manager) without admitting each other's peers.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import zmq
import zmq.auth.thread

from clusterflow.cluster.contract import ENV_AUTH, ENV_SECRET, ENV_SECRET_FILE
from clusterflow.errors import ConfigError

log = logging.getLogger(__name__)

AuthMode = Literal["plain", "curve"]
AUTH_MODES: tuple[AuthMode, ...] = ("plain", "curve")
PLAIN_USERNAME = "clusterflow"
SECRET_BYTES = 32
ENV_AUTH_MODE = ENV_AUTH


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``: traffic that never leaves this host."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class Credentials:
    """A cluster's shared secret and the mechanism to prove it with.

    Build with ``generate()``, ``from_file()`` or ``from_env()``; never log ``secret``.
    """

    secret: bytes = field(repr=False)
    """32 random bytes shared by every task of one cluster."""
    mode: AuthMode | None = None
    """Force a mechanism; None picks plain on loopback and curve elsewhere."""

    def __post_init__(self) -> None:
        if len(self.secret) != SECRET_BYTES:
            raise ConfigError(
                f"cluster secret must be {SECRET_BYTES} bytes, got {len(self.secret)}"
            )
        if self.mode is not None and self.mode not in AUTH_MODES:
            raise ConfigError(f"unknown auth mode {self.mode!r}; expected plain or curve")

    @classmethod
    def generate(cls, mode: AuthMode | None = None) -> Credentials:
        """A fresh random secret for a new cluster."""
        return cls(secrets.token_bytes(SECRET_BYTES), mode)

    @classmethod
    def from_hex(cls, text: str, mode: AuthMode | None = None) -> Credentials:
        """Parses the hex form written by ``to_file``."""
        try:
            raw = bytes.fromhex(text.strip())
        except ValueError as exc:
            raise ConfigError("cluster secret is not hex text") from exc
        return cls(raw, mode)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], mode: AuthMode | None = None) -> Credentials:
        """Reads a secret file written by ``to_file``.

        Raises:
            ConfigError: the file is missing, unreadable or not a secret.
        """
        try:
            text = Path(path).read_text(encoding="ascii")
        except OSError as exc:
            raise ConfigError(f"cannot read cluster secret file {str(path)!r}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{str(path)!r}: cluster secret is not hex text") from exc
        try:
            return cls.from_hex(text, mode)
        except ConfigError as exc:
            raise ConfigError(f"{str(path)!r}: {exc}") from exc

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Credentials | None:
        """The credentials a launcher passed to this process, or None if it passed none."""
        env = os.environ if environ is None else environ
        raw_mode = env.get(ENV_AUTH_MODE) or None
        if raw_mode is not None and raw_mode not in AUTH_MODES:
            raise ConfigError(f"{ENV_AUTH_MODE}={raw_mode!r}; expected plain or curve")
        mode: AuthMode | None = raw_mode  # type: ignore[assignment]
        if env.get(ENV_SECRET_FILE):
            return cls.from_file(env[ENV_SECRET_FILE], mode)
        if env.get(ENV_SECRET):
            try:
                return cls.from_hex(env[ENV_SECRET], mode)
            except ConfigError as exc:
                raise ConfigError(f"{ENV_SECRET}: {exc}") from exc
        return None

    def to_hex(self) -> str:
        return self.secret.hex()

    def to_file(self, path: str | os.PathLike[str]) -> None:
        """Writes the secret readable by the owner only (created 0600, never widened)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        # O_CREAT's mode applies only to a new file: narrow an existing one before the
        # secret is written into it, not after.
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_hex() + "\n")

    def resolve_mode(self, host: str) -> AuthMode:
        """The mechanism for a connection to or a bind on ``host``."""
        if self.mode is not None:
            return self.mode
        return "plain" if is_loopback(host) else "curve"

    @property
    def domain(self) -> str:
        """The ZAP domain of this cluster: a digest of the secret, so never the secret."""
        return hashlib.sha256(b"clusterflow-zap-domain" + self.secret).hexdigest()[:32]

    @property
    def password(self) -> str:
        return hashlib.sha256(b"clusterflow-plain" + self.secret).hexdigest()

    @property
    def curve_keypair(self) -> tuple[bytes, bytes]:
        """(public, secret) Z85 keys derived from the cluster secret."""
        seed = hashlib.sha256(b"clusterflow-curve" + self.secret).digest()
        secret_key = zmq.utils.z85.encode(seed)
        return zmq.curve_public(secret_key), secret_key

    def apply_server(self, sock: zmq.Socket[bytes], host: str) -> AuthMode:
        """Makes ``sock`` (before bind) demand these credentials from every peer.

        Raises:
            ConfigError: ``plain`` forced on a bind beyond loopback. Its password crosses
                the network in clear text, so any host on the path could replay it and
                join the cluster; beyond loopback only ``curve`` is allowed.
        """
        mode = self.resolve_mode(host)
        if mode == "plain" and not is_loopback(host):
            raise ConfigError(
                f"plain auth on {host!r} is refused: beyond loopback its password travels "
                "in clear text; use curve (the default there)"
            )
        _authenticator(sock.context).admit(self, mode)
        sock.zap_domain = self.domain.encode()
        if mode == "plain":
            sock.plain_server = True
        else:
            public, secret_key = self.curve_keypair
            sock.curve_server = True
            sock.curve_publickey = public
            sock.curve_secretkey = secret_key
        return mode

    def apply_client(self, sock: zmq.Socket[bytes], host: str) -> AuthMode:
        """Makes ``sock`` (before connect) present these credentials."""
        mode = self.resolve_mode(host)
        if mode == "plain":
            sock.plain_username = PLAIN_USERNAME.encode()
            sock.plain_password = self.password.encode()
        else:
            public, secret_key = self.curve_keypair
            sock.curve_serverkey = public
            sock.curve_publickey = public
            sock.curve_secretkey = secret_key
        return mode


class _CurveKeys:
    """ZAP credentials provider: admits exactly the public keys of admitted secrets."""

    def __init__(self) -> None:
        self.allowed: set[bytes] = set()

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key in self.allowed


class _ProcessAuthenticator:
    """One ZAP thread per context, holding the credentials of every cluster served here."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.context = context
        self._lock = threading.Lock()
        self._auth = zmq.auth.thread.ThreadAuthenticator(context, log=log)
        self._auth.start()
        self._passwords: dict[str, dict[str, str]] = {}
        self._curve: dict[str, _CurveKeys] = {}

    def admit(self, credentials: Credentials, mode: AuthMode) -> None:
        domain = credentials.domain
        with self._lock:
            if mode == "plain":
                if domain not in self._passwords:
                    self._passwords[domain] = {PLAIN_USERNAME: credentials.password}
                    self._auth.configure_plain(domain, self._passwords[domain])
            elif domain not in self._curve:
                keys = _CurveKeys()
                keys.allowed.add(credentials.curve_keypair[0])
                self._curve[domain] = keys
                self._auth.configure_curve_callback(domain, keys)

    @property
    def alive(self) -> bool:
        return self._auth.is_alive()

    def stop(self) -> None:
        self._auth.stop()


_AUTHENTICATORS: dict[int, _ProcessAuthenticator] = {}
_AUTHENTICATORS_LOCK = threading.Lock()


def _authenticator(context: zmq.Context[zmq.Socket[bytes]]) -> _ProcessAuthenticator:
    with _AUTHENTICATORS_LOCK:
        key = id(context)
        found = _AUTHENTICATORS.get(key)
        # An id outlives its object: a context built where a terminated one lived must
        # not inherit that one's (stopped) authenticator, or its sockets would have none.
        if found is None or found.context is not context or not found.alive:
            found = _AUTHENTICATORS[key] = _ProcessAuthenticator(context)
        return found


def stop_authenticators(context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
    """Stops the ZAP thread of ``context`` (of every context when None) and closes its sockets.

    Call after the server sockets it guards are closed; a server built later starts a
    new one.
    """
    with _AUTHENTICATORS_LOCK:
        keys = [k for k, a in _AUTHENTICATORS.items() if context is None or a.context is context]
        stopping = [_AUTHENTICATORS.pop(k) for k in keys]
    for authenticator in stopping:
        authenticator.stop()
