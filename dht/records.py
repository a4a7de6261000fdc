"""Typed, expiring, validated records that a run keeps in the DHT, under the run's namespace.

Keys (every one prefixed with the run id; a subkey per peer where peers write their own entry):

* ``{run_id}:peers``   subkey peer id -> ``Announcement`` (``None`` is a withdrawal tombstone)
* ``{run_id}:config``  ``RunRecord``, the run's flat training config
* ``{run_id}:metrics`` subkey peer id -> ``Metrics``

Every record expires. Values travel as plain msgpack (``model_dump(mode="json")``) and are
validated again when read: readers skip malformed or expired entries and never raise on them, and
ignore the fields of an announcement or metrics record that a newer murmur added (``_Record.decode``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Generic, TypeVar

from hivemind.dht import DHT
from hivemind.utils import MPFuture
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS, ValueWithExpiration, get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .addresses import AddressError, parse_peer_multiaddr

__all__ = [
    "PROTOCOL_VERSION",
    "Announcement",
    "Metrics",
    "PeerState",
    "RunRecord",
    "RunRecords",
    "config_digest",
    "validate_run_id",
]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 3  # the peers' protocol (averaging.wire's messages); peers of another version never meet
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MAX_ADDRESSES = 32
_MAX_CONFIG_ITEMS = 256

T = TypeVar("T")
Model = TypeVar("Model", bound="_Record")
PeerId = Annotated[str, Field(min_length=1, max_length=128)]
Count = Annotated[int, Field(ge=0)]


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is 1-64 characters of [A-Za-z0-9_.-], not all dots; ValueError (one line) otherwise."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"bad run id {run_id!r}: it must be 1-64 characters of A-Z a-z 0-9 _ . -")
    if not run_id.strip("."):  # a simulation's default folder, runs/RUN: runs/.. is the folder it was started in
        raise ValueError(f"bad run id {run_id!r}: it must not be only dots")
    return run_id


def config_digest(config: dict[str, Any]) -> str:
    """A short digest of a run's flat training config, which peers announce: peers of one run average only with
    peers that train on the same config (its creator may publish another under the same run id)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    # Whether a stored value's fields that this murmur does not know are ignored when it is read (`decode`): a newer
    # peer may add one (the announcement's `config` was added so), and older peers should still see that peer. Only
    # for records signed whole (`dht.signing`: the signature covers every byte of the value, at most 64 KiB), so an
    # unknown field is its signer's own; the run config's signature covers only its known fields, so it stays
    # closed. Built here, in murmur's own code, a record refuses an unknown field either way (a typo).
    newer_fields_ignored: ClassVar[bool] = False

    @classmethod
    def decode(cls, value: Any):
        """The record a stored value holds (pydantic's ValidationError if it holds none)."""
        if cls.newer_fields_ignored and isinstance(value, dict):
            value = {name: field for name, field in value.items() if name in cls.model_fields}
        return cls.model_validate(value)


class PeerState(StrEnum):
    TRAINING = "training"  # taking inner steps toward its appointment
    READY = "ready"  # at its appointment: gathering with the other peers of that round
    FINISHING = "finishing"  # training is over; averaging anchors only (finish rounds) with other finishing peers
    DONE = "done"  # finished: no longer averaging


class Announcement(_Record):
    """A live peer: where to reach it and how far along it is."""

    newer_fields_ignored: ClassVar[bool] = True
    peer_id: PeerId
    addresses: list[str] = Field(max_length=_MAX_ADDRESSES)  # multiaddrs ending in /p2p/<peer_id>
    step: Count
    samples_per_second: float = Field(ge=0)
    state: PeerState = Field(strict=False)  # accepts the wire value "ready" as well as PeerState.READY
    version: int = Field(default=PROTOCOL_VERSION, ge=1)  # protocol version the peer speaks
    client_mode: bool = False  # True: reachable only through relays or not at all
    # the round it trains toward or gathers at (averaging.groups.Appointment.key), and its measured pace
    appointment: str | None = Field(default=None, max_length=64)
    step_seconds: float | None = Field(default=None, ge=0)
    exchange_seconds: float | None = Field(default=None, ge=0)
    config: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")  # config_digest of the config it trains on
    # seconds its rounds add to its machine's clock to follow the swarm's (dht.clock; its operator's to set right)
    clock: float | None = Field(default=None, ge=-MAX_DHT_TIME_DISCREPANCY_SECONDS, le=MAX_DHT_TIME_DISCREPANCY_SECONDS,
                                allow_inf_nan=False)  # fmt: skip

    @field_validator("addresses")
    @classmethod
    def _addresses_parse(cls, addresses: list[str]) -> list[str]:
        try:
            return [parse_peer_multiaddr(address) for address in addresses]
        except AddressError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _addresses_name_this_peer(self) -> Announcement:
        suffix = f"/p2p/{self.peer_id}"
        for address in self.addresses:
            if not address.endswith(suffix):
                raise ValueError(f"address {address!r} does not end with {suffix}")
        return self


class Metrics(_Record):
    """A peer's running totals, published for dashboards and benchmarks."""

    newer_fields_ignored: ClassVar[bool] = True
    peer_id: PeerId
    step: Count
    samples: Count
    loss: float | None
    exchanges_ok: Count
    exchanges_failed: Count
    bytes_sent: Count
    bytes_received: Count
    # peer.sketch.AnchorSketch of the peer's anchor: the dashboard's estimate of the consensus distance
    sketch: list[float] | None = Field(default=None, max_length=1024)


class RunRecord(_Record):
    """The run's training config (flat), published by the peer that created the run."""

    run_id: str
    config: dict[Annotated[str, Field(max_length=128)], str | int | float | bool | None] = Field(
        max_length=_MAX_CONFIG_ITEMS
    )
    created_by: PeerId
    # a private run: an HMAC of the run id under the run's secret (averaging.access.AccessPolicy.run_check), so
    # that a joiner knows at once whether it may train here; None for an open run
    secret_check: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    # The creator's signature over the fields above (dht.signing), kept in the record so that
    # any peer can republish the creator's config unchanged; None on nodes without run validators.
    public_key: str | None = Field(default=None, max_length=2048)
    signature: str | None = Field(default=None, max_length=2048)

    @field_validator("run_id")
    @classmethod
    def _run_id_is_valid(cls, run_id: str) -> str:
        return validate_run_id(run_id)


_PIPE_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Request(Generic[T]):
    """One DHT request and how to turn its raw result into T: the one sync/async bridge.

    ``start`` sends the request and returns hivemind's MPFuture. It runs only once the caller has
    chosen how to wait, because an MPFuture can be awaited only on the loop running when it was made.
    """

    start: Callable[[], MPFuture]
    finish: Callable[[Any], T]
    timeout: float

    def _send(self) -> MPFuture:
        # DHT writes requests to one multiprocessing pipe without a lock of its own, and the
        # heartbeat thread, the training thread and the event-loop thread all make requests
        with _PIPE_LOCK:
            return self.start()

    def wait(self) -> T:
        """Block for the result. Refused inside a running event loop, which it would stall."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("a blocking DHT call inside an event loop would stall it; await the a_ twin")
        future = self._send()
        try:
            return self.finish(future.result(timeout=self.timeout))
        except TimeoutError:
            future.cancel()
            raise self._timed_out() from None

    async def wait_async(self) -> T:
        future = self._send()
        try:
            return self.finish(await asyncio.wait_for(_awaitable(future), self.timeout))
        except TimeoutError:
            future.cancel()
            raise self._timed_out() from None
        except asyncio.CancelledError:
            future.cancel()
            raise

    def _timed_out(self) -> TimeoutError:
        """A TimeoutError that says what timed out: a bare one printed as 'murmur status: error: TimeoutError'."""
        return TimeoutError(f"the DHT did not answer within {self.timeout:g} s")


async def _awaitable(future: MPFuture) -> Any:
    return await future


class RunRecords:
    """Read and write one run's records. Each blocking method has an ``a_`` twin for event loops."""

    def __init__(
        self,
        dht: DHT,
        run_id: str,
        *,
        announce_ttl: float = 15.0,
        metrics_ttl: float = 60.0,
        config_ttl: float = 3600.0,
        request_timeout: float = 30.0,
    ) -> None:
        for name, ttl in [("announce_ttl", announce_ttl), ("metrics_ttl", metrics_ttl), ("config_ttl", config_ttl)]:
            if not ttl > 0:
                raise ValueError(f"{name} must be positive, got {ttl!r}")
        self.dht = dht
        self.run_id = validate_run_id(run_id)
        self.announce_ttl, self.metrics_ttl, self.config_ttl = announce_ttl, metrics_ttl, config_ttl
        self.request_timeout = request_timeout
        self._decoded: dict[type, dict[str, tuple[float, Any]]] = {}  # model -> subkey -> (expiration, record)
        self.peers_key = f"{run_id}:peers"
        self.config_key = f"{run_id}:config"
        self.metrics_key = f"{run_id}:metrics"

    # Requests: each builds one _Request; the public pairs below only choose how to wait for it.

    def _store(self, key: str, value: Any, ttl: float, subkey: str | None = None) -> _Request[bool]:
        def start() -> MPFuture:
            return self.dht.store(key, value, get_dht_time() + ttl, subkey=subkey, return_future=True)

        return _Request(start, bool, self.request_timeout)

    def _get(self, key: str, finish: Callable[[Any], T]) -> _Request[T]:
        # latest=True keeps searching past the first copy found, so subkeys held by different nodes merge.
        return _Request(lambda: self.dht.get(key, latest=True, return_future=True), finish, self.request_timeout)

    def _announce(self, a: Announcement) -> _Request[bool]:
        return self._store(self.peers_key, a.model_dump(mode="json"), self.announce_ttl, subkey=a.peer_id)

    def _withdraw(self, peer_id: str) -> _Request[bool]:
        # Hivemind cannot delete. A subkey is replaced only by a later expiration, and now + ttl is
        # later than that of any announcement made before now with the same ttl.
        return self._store(self.peers_key, None, self.announce_ttl, subkey=peer_id)

    def _peers(self) -> _Request[dict[str, Announcement]]:
        return self._get(self.peers_key, lambda found: self._by_peer(found, Announcement))

    def _peers_with_expiration(self) -> _Request[dict[str, tuple[Announcement, float]]]:
        def finish(found: ValueWithExpiration | None) -> dict[str, tuple[Announcement, float]]:
            peers = self._by_peer(found, Announcement)  # non-empty only if found.value is a dict of subkeys
            return {peer_id: (a, found.value[peer_id].expiration_time) for peer_id, a in peers.items()}

        return self._get(self.peers_key, finish)

    def _publish_config(self, record: RunRecord) -> _Request[bool]:
        if record.run_id != self.run_id:
            raise ValueError(f"config is for run {record.run_id!r}, not {self.run_id!r}")
        return self._store(self.config_key, record.model_dump(mode="json"), self.config_ttl)

    def _fetch_config(self) -> _Request[RunRecord | None]:
        return self._get(self.config_key, self._config)

    def fetch_config_with_expiration(self) -> tuple[RunRecord, float] | None:
        """``fetch_config()`` with the DHT time the record found expires (it was last stored ``config_ttl`` before,
        by its creator or by a peer that keeps it)."""

        def finish(found: ValueWithExpiration | None) -> tuple[RunRecord, float] | None:
            record = self._config(found)
            return None if record is None else (record, found.expiration_time)

        return self._get(self.config_key, finish).wait()

    def _publish_metrics(self, m: Metrics) -> _Request[bool]:
        return self._store(self.metrics_key, m.model_dump(mode="json"), self.metrics_ttl, subkey=m.peer_id)

    def _metrics(self) -> _Request[dict[str, Metrics]]:
        return self._get(self.metrics_key, lambda found: self._by_peer(found, Metrics))

    def announce(self, a: Announcement) -> bool:
        return self._announce(a).wait()

    async def a_announce(self, a: Announcement) -> bool:
        return await self._announce(a).wait_async()

    def withdraw(self, peer_id: str, timeout: float | None = None) -> bool:
        """Replace the peer's announcement by none; waits `timeout` seconds at most (default: `request_timeout`)."""
        request = self._withdraw(peer_id)
        return (request if timeout is None else replace(request, timeout=timeout)).wait()

    async def a_withdraw(self, peer_id: str) -> bool:
        return await self._withdraw(peer_id).wait_async()

    def peers(self) -> dict[str, Announcement]:
        return self._peers().wait()

    async def a_peers(self) -> dict[str, Announcement]:
        return await self._peers().wait_async()

    def peers_with_expiration(self) -> dict[str, tuple[Announcement, float]]:
        """``peers()`` with the DHT time each announcement expires (it was stored ``announce_ttl`` before)."""
        return self._peers_with_expiration().wait()

    async def a_peers_with_expiration(self) -> dict[str, tuple[Announcement, float]]:
        return await self._peers_with_expiration().wait_async()

    def publish_config(self, record: RunRecord) -> bool:
        return self._publish_config(record).wait()

    async def a_publish_config(self, record: RunRecord) -> bool:
        return await self._publish_config(record).wait_async()

    def fetch_config(self) -> RunRecord | None:
        return self._fetch_config().wait()

    async def a_fetch_config(self) -> RunRecord | None:
        return await self._fetch_config().wait_async()

    def publish_metrics(self, m: Metrics) -> bool:
        return self._publish_metrics(m).wait()

    async def a_publish_metrics(self, m: Metrics) -> bool:
        return await self._publish_metrics(m).wait_async()

    def metrics(self) -> dict[str, Metrics]:
        return self._metrics().wait()

    async def a_metrics(self) -> dict[str, Metrics]:
        return await self._metrics().wait_async()

    # Decoding: never raises on what other peers stored.

    def _by_peer(self, found: ValueWithExpiration | None, model: type[Model]) -> dict[str, Model]:
        if found is None:
            return {}
        if not isinstance(found.value, dict):
            logger.debug("skipping %s: a %s, not a dict of subkeys", model.__name__, type(found.value).__name__)
            return {}
        now = get_dht_time()
        records: dict[str, Model] = {}
        # An entry read before with the same expiration is the same signed value (a later store by its signer has
        # a later expiration): it is not validated again. Only the last read's entries are kept, so a flood of
        # announcements costs one validation per store, not one per read, and no memory beyond the last read.
        known = self._decoded.get(model, {})
        decoded: dict[str, tuple[float, Model | None]] = {}
        for subkey, entry in found.value.items():
            if entry.value is None or entry.expiration_time < now:
                continue  # withdrawn or expired
            cached = known.get(subkey)
            if cached is not None and cached[0] == entry.expiration_time:
                record = cached[1]
            else:
                record = _decode(model, entry.value, where=f"{model.__name__} under subkey {subkey!r}")
                if record is not None and getattr(record, "peer_id", None) != subkey:
                    logger.debug("skipping %s under subkey %r: it names peer %r", model.__name__, subkey,
                                 record.peer_id)  # fmt: skip
                    record = None
            if isinstance(subkey, str):
                decoded[subkey] = (entry.expiration_time, record)
            if record is not None:
                records[subkey] = record
        self._decoded[model] = decoded  # one reference swap: readers on other threads see the old or the new
        return records

    def _config(self, found: ValueWithExpiration | None) -> RunRecord | None:
        if found is None or found.expiration_time < get_dht_time():
            return None
        record = _decode(RunRecord, found.value, where=f"run config of {self.run_id!r}")
        if record is not None and record.run_id != self.run_id:
            logger.debug("skipping run config: it is for run %r, not %r", record.run_id, self.run_id)
            return None
        return record


def _decode(model: type[Model], value: Any, where: str) -> Model | None:
    """Validate a stored value against ``model`` (`_Record.decode`); None (and one debug line) if it does not fit."""
    try:
        return model.decode(value)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors())
        logger.debug("skipping malformed %s: %s", where, " ".join(problems.split()))
        return None
