"""Checks for the addresses a peer dials or listens on.

A peer address is a libp2p multiaddr with a transport and the peer's id, such as
``/ip4/203.0.113.5/tcp/31337/p2p/QmXyz...``. Everything is validated with the ``multiaddr``
package and returned as a canonical ``str``: hivemind wants strings, not ``multiaddr.Multiaddr``.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Iterable

from multiaddr import Multiaddr

__all__ = [
    "AddressError",
    "host_of",
    "host_problem",
    "parse_host",
    "parse_peer_multiaddr",
    "parse_peer_multiaddrs",
    "port_problem",
]

_HOST_PROTOCOLS = frozenset({"ip4", "ip6", "dns", "dns4", "dns6"})
_QUIC_PROTOCOLS = frozenset({"quic", "quic-v1"})
_MAX_LENGTH = 300  # characters of an address or a reason quoted in an error


class AddressError(ValueError):
    """A bad peer address or listen host. ``str(e)`` is one line naming the address and why."""

    def __init__(self, kind: str, text: object, reason: str) -> None:
        super().__init__(f"bad {kind} {_shorten(repr(text))}: {_shorten(' '.join(reason.split()))}")


def _shorten(line: str) -> str:
    return line if len(line) <= _MAX_LENGTH else line[: _MAX_LENGTH - 3] + "..."


def _transport_error(names: list[str]) -> str | None:
    """Why these protocol names are not host/tcp/p2p or host/udp/quic/p2p, or None if they are."""
    if not names or names[-1] != "p2p":
        return "it must end with /p2p/<peer id>"
    path = names[:-1]
    if not path or path[0] not in _HOST_PROTOCOLS:
        return "it must start with /ip4, /ip6, /dns, /dns4 or /dns6"
    if path[1:] == ["tcp"] or (len(path) == 3 and path[1] == "udp" and path[2] in _QUIC_PROTOCOLS):
        return None
    return "the transport must be /tcp/<port> or /udp/<port>/quic-v1 (or /quic)"


def parse_peer_multiaddr(text: str) -> str:
    """Validate one peer multiaddr and return its canonical string form."""
    if not isinstance(text, str):
        raise AddressError("multiaddr", text, f"expected a str, got {type(text).__name__}")
    stripped = text.strip()
    if not stripped:
        raise AddressError("multiaddr", text, "it is empty")
    try:
        maddr = Multiaddr(stripped)
        values = [(proto.name, maddr.value_for_protocol(proto.code)) for proto in maddr.protocols()]
    except Exception as e:  # the multiaddr package raises several unrelated types
        raise AddressError("multiaddr", text, getattr(e, "message", None) or str(e) or type(e).__name__) from e

    names = [name for name, _ in values]
    reason = _transport_error(names)
    if reason is None:
        port = int(values[1][1])
        if not 0 < port < 65536:
            reason = f"port {port} is not in 1..65535"
    if reason is not None:
        raise AddressError("multiaddr", text, reason)
    return str(maddr)


def host_of(addresses: Iterable[str]) -> str | None:
    """The host (ip4, ip6 or dns value) of the first of `addresses` that names one, else None."""
    for address in addresses:
        try:
            parts = Multiaddr(address).items()
        except Exception:  # whatever the multiaddr package raises on a bad one: it names no host
            continue
        for protocol, value in parts:
            if protocol.name in _HOST_PROTOCOLS:
                return str(value)
    return None


def parse_peer_id(text: str) -> str:
    """Validate a base58 libp2p peer id (as `/p2p/<id>` carries it); return it stripped."""
    if not isinstance(text, str):
        raise AddressError("peer id", text, f"expected a str, got {type(text).__name__}")
    try:
        return str(Multiaddr(f"/p2p/{text.strip()}")).removeprefix("/p2p/")
    except Exception as e:  # the multiaddr package raises several unrelated types
        raise AddressError("peer id", text, "it is not a base58 peer id (as in /p2p/<peer id>)") from e


def parse_peer_multiaddrs(texts: Iterable[str]) -> list[str]:
    """Validate every address (all or nothing); return them canonical, de-duplicated, in order."""
    if isinstance(texts, str):
        raise AddressError("multiaddr list", texts, "expected a list of addresses, got one str")
    return list(dict.fromkeys(parse_peer_multiaddr(text) for text in texts))


def parse_host(host: str) -> str:
    """Validate a literal IPv4 or IPv6 address to listen on; return its compressed form."""
    if not isinstance(host, str):
        raise AddressError("host", host, f"expected a str, got {type(host).__name__}")
    try:
        return str(ipaddress.ip_address(host.strip()))
    except ValueError:
        raise AddressError("host", host, "it must be a literal IPv4 or IPv6 address") from None


def host_problem(host: str) -> str | None:
    """Why nothing can listen on `host` (not an address of this machine), or None."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError as e:
            return f"{host} cannot be listened on: {e.strerror}"
    return None


def port_problem(host: str, port: int) -> str | None:
    """Why a node cannot listen on `host`:`port` (it is in use, or cannot be bound), or None; port 0 is always free.

    p2pd listens with SO_REUSEPORT, so a second one on a taken port would share it silently: this probe binds
    without it (with SO_REUSEADDR, so connections of a stopped node in TIME_WAIT do not count) and fails the way
    a second listener should.
    """
    if port == 0:
        return None
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror}"
            return f"{host}:{port} {why}"
    return None
