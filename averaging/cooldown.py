"""Cool-down for peers that keep misbehaving: not asked, and declined, for a while.

A strike is an exchange that a partner broke on purpose or by a bug: a message that fails decoding
or the layout checks, a wrong session, an insane step, a contribution that robust aggregation
rejects. Timeouts, closed streams and declines are not strikes: honest peers on bad links cause
them. ``strikes`` strikes within ``memory`` seconds put the peer on cool-down for ``duration``.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("murmur.averaging")


@dataclass(frozen=True, kw_only=True)
class CooldownConfig:
    strikes: int = 2
    memory: float = 600.0  # seconds a strike counts
    duration: float = 600.0  # seconds a peer stays on cool-down
    max_peers: int = 10_000  # bound on the peers tracked, so a flood of fresh ids cannot grow memory

    def __post_init__(self) -> None:
        if self.strikes < 1 or min(self.memory, self.duration) <= 0 or self.max_peers < 1:
            raise ValueError("cool-down needs strikes >= 1, positive memory and duration, max_peers >= 1")


class Cooldown:
    def __init__(self, config: CooldownConfig = CooldownConfig(), clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._strikes: collections.OrderedDict[str, list[float]] = collections.OrderedDict()
        self._until: dict[str, float] = {}

    def strike(self, peer: str, reason: str) -> bool:
        """Count one strike against `peer`; True if that put it on cool-down."""
        now = self._clock()
        recent = [t for t in self._strikes.pop(peer, []) if now - t < self.config.memory] + [now]
        self._strikes[peer] = recent
        while len(self._strikes) > self.config.max_peers:
            self._strikes.popitem(last=False)
        if len(recent) < self.config.strikes:
            return False
        self._strikes.pop(peer)
        self._until[peer] = now + self.config.duration
        self._until = {p: t for p, t in self._until.items() if t > now}
        logger.warning("peer %s on cool-down for %.0f s after %d bad exchanges; last: %s",
                       peer[-8:], self.config.duration, len(recent), reason)  # fmt: skip
        return True

    def strikes(self, peer: str) -> int:
        """Strikes against `peer` that still count (0 once it is on cool-down)."""
        return sum(self._clock() - t < self.config.memory for t in self._strikes.get(peer, []))

    def cooling(self, peer: str) -> bool:
        until = self._until.get(peer)
        return until is not None and self._clock() < until
