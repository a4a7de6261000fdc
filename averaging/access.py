"""Private runs: who may exchange with us (or download our state), checked before any model data moves.

An `AccessPolicy` holds an optional shared run secret and an optional allowlist of peer ids; the
default admits everyone. With a secret, each side proves it knows the secret without sending it:
a sender attaches ``auth = HMAC-SHA256(secret, context|sender|receiver|nonce|time)`` and the time to
its message's meta, and the receiver recomputes it. The peer ids come from the transport (libp2p
authenticates them), the nonce is the exchange's random session id and the time must be recent,
so a proof cannot be replayed by another peer, to another peer, or for another exchange.

Any handler uses it the same way: the requester adds ``policy.credentials(...)`` to its first
message; the server calls ``policy.check(...)`` on it and, if that returns a reason, refuses with
that reason before sending anything else; and the server's first reply carries credentials of its
own that the requester checks, so neither side hands data to an impostor.

The run record says up front whether a run is private: the bootstrap node publishes
``run_check(run_id)``, an HMAC of the run id under the secret (not the secret), and a joiner calls
``refuses_run`` on it before it starts training: without the secret, or with another one, it stops
with one line instead of training alone, refused by every peer.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}")  # base58
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096


class AccessError(ValueError):
    """A bad secret file or allowlist; str(e) is one line."""


@dataclass(frozen=True, kw_only=True)
class AccessPolicy:
    secret: bytes | None = field(default=None, repr=False)
    allowed: frozenset[str] | None = None  # None: any peer id (that knows the secret, if there is one)
    max_skew: float = 300.0  # seconds a proof stays valid (clock skew between peers included)
    clock: Callable[[], float] = field(default=time.time, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.secret is not None and not MIN_SECRET_BYTES <= len(self.secret) <= MAX_SECRET_BYTES:
            raise AccessError(f"the run secret must be {MIN_SECRET_BYTES}..{MAX_SECRET_BYTES} bytes")
        if self.allowed is not None:
            bad = sorted(p for p in self.allowed if not isinstance(p, str) or not _PEER_ID.fullmatch(p))
            if bad:
                raise AccessError(f"not a peer id: {bad[0]!r}")

    @property
    def open(self) -> bool:
        return self.secret is None and self.allowed is None

    def admits(self, peer: str) -> bool:
        """Whether `peer` is on the allowlist (always, without one): whom we may ask at all."""
        return self.allowed is None or peer in self.allowed

    def credentials(self, *, context: str, local: str, remote: str, nonce: int) -> dict[str, str | int]:
        """Meta entries proving to `remote` that `local` knows the secret, for this context and nonce."""
        if self.secret is None:
            return {}
        now = int(self.clock())
        return {"auth": self._mac(context, local, remote, nonce, now), "auth_t": now}

    def check(self, *, context: str, local: str, remote: str, nonce: int, meta: Mapping[str, object]) -> str | None:
        """None if `remote` may go on; otherwise the one-line reason to refuse it."""
        if not self.admits(remote):
            return "not authorized: peer is not on this run's allowlist"
        if self.secret is None:
            return None
        mac, at = meta.get("auth"), meta.get("auth_t")
        if not isinstance(mac, str) or type(at) is not int:
            return "not authorized: this run is private and the request carries no proof of its secret"
        if abs(self.clock() - at) > self.max_skew:
            return "not authorized: the proof of the run secret is stale (check the clocks)"
        if not hmac.compare_digest(mac, self._mac(context, remote, local, nonce, at)):
            return "not authorized: wrong run secret"
        return None

    def run_check(self, run_id: str) -> str | None:
        """What the run record carries for a private run (None for an open one): proves nothing to anyone who
        lacks the secret, and lets a joiner tell at once whether its secret is the run's."""
        if self.secret is None:
            return None
        return hmac.new(self.secret, f"murmur-run|{run_id}".encode(), hashlib.sha256).hexdigest()

    def refuses_run(self, run_id: str, check: str | None) -> str | None:
        """None if a peer with this policy can train in the run whose record carries `check`; else why not."""
        if check is None:
            return None
        if self.secret is None:
            return f"run '{run_id}' is private: pass --run-secret-file FILE with the run's secret"
        if not hmac.compare_digest(check, self.run_check(run_id) or ""):
            return f"run '{run_id}' is private and this run secret is not its secret: check --run-secret-file"
        return None

    def _mac(self, context: str, sender: str, receiver: str, nonce: int, at: int) -> str:
        message = f"murmur-access|{context}|{sender}|{receiver}|{nonce}|{at}".encode()
        return hmac.new(self.secret or b"", message, hashlib.sha256).hexdigest()


def load_policy(secret_file: Path | None, allow_peers: Iterable[str] | None) -> AccessPolicy:
    """The policy of the CLI flags; AccessError (one line) on an unreadable or bad secret file, or an allowlist
    entry that is no peer id (a peer id mistyped would leave the peer training alone, refusing everyone)."""
    secret = None
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                secret = f.read(MAX_SECRET_BYTES + 1).strip()
        except OSError as e:
            raise AccessError(f"cannot read run secret file {str(secret_file)!r}: {e.strerror or e}") from None
        if len(secret) < MIN_SECRET_BYTES:
            raise AccessError(f"run secret file {str(secret_file)!r} holds fewer than {MIN_SECRET_BYTES} bytes")
        if len(secret) > MAX_SECRET_BYTES:
            raise AccessError(f"run secret file {str(secret_file)!r} is larger than {MAX_SECRET_BYTES} bytes")
    allowed = None if allow_peers is None else frozenset(allow_peers)
    policy = AccessPolicy(secret=secret, allowed=allowed)
    if allowed:  # base58, as the policy checks; and a peer id, which takes a decoding
        # imported here: a process that only exchanges never needs the DHT package (tests/test_bench_model_scale.py)
        from murmur.dht.addresses import AddressError, parse_peer_id

        for peer in sorted(allowed):
            try:
                parse_peer_id(peer)
            except AddressError as e:
                raise AccessError(f"--allow-peers: {e}") from None
    return policy
