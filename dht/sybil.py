"""What a Sybil can put in a run's roster: records stored only by the peer they name, answers of bounded size.

A ``{run}:peers`` or ``{run}:metrics`` record sits under its signer's peer id (``dht.signing``), and every
peer stores its own, straight to the key's replicas, every few seconds. Signatures alone cost a Sybil
nothing: one DHT node signs a thousand fake announcements with a thousand fresh keys, and every replica
then checks each signature, holds each record, and hands all of them to every reader of the roster, twice
a second. A node of the run therefore (``install``, run inside its DHT worker):

* **as a replica**, refuses before any signature is checked
  - a one-subkey store of these keys whose subkey is not the peer id of the node that sent it (the
    libp2p peer that sent the RPC, not anything the request says);
  - a whole-dictionary store of them: hivemind's hand-over of what a new replica should hold, and its
    cache-on-read copy to the nearest node. Nobody needs either: a new replica has every live peer's own
    record within one announcement period;
* **as a reader**, drops whole any one node's answer that carries more than ``max_answer`` records of these
  keys, before checking a single one of them, and asks that node for them no more for ``shun_seconds``. A
  Sybil that runs its own DHT server, placed on the roster key so that every read asks it, keeps whatever it
  stores for itself; the cap makes each such server worth at most ``max_answer`` fakes in a reader's roster,
  where it was worth any number, and the shun spares the reader its oversized answers twice a second. An
  honest replica holds only the run's live peers. hivemind merges what a read finds into the first copy it
  holds, which is the node's own stored one where it is a replica of the key, and then serves it as stored: a
  read of these keys starts from a copy of it instead (``_CopyOnRead``), so no answer, under the cap or not,
  is passed on by an honest replica;
* **as a reader and a writer**, waits ``answer_seconds`` at most for one node's answer to a find or a store of
  these keys, where hivemind waits its RPC timeout (3 s) on every node it asks: a read of the roster asks every
  replica and an announcement waits for every replica's store, so one replica that answers late, stalled (a DHT
  worker waiting seconds for a busy CPU) or on purpose (a Sybil's server that answers just inside the timeout,
  which hivemind counts a success), held every reader's roster and every peer's heartbeat that long, and a
  roster seconds old at an appointment leaves its reader alone that round. A late answer counts as none, and
  the node goes on hivemind's blacklist: its traversals leave it out for 5 s, twice as long after each failure
  in a row, and no store of these keys goes to it meanwhile. Nothing is lost: each peer stores its own record
  on every replica it finds.

Other keys, and the run's config (which anyone may republish unchanged), pass through untouched.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import time
import weakref
from dataclasses import dataclass

import msgpack
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2
from hivemind.utils.timed_storage import ValueWithExpiration

from .signing import run_key_ids

__all__ = ["SybilGuard", "counts", "install"]

logger = logging.getLogger(__name__)

MAX_ANSWER = 512  # a run's peers one node's answer may carry; more is a Sybil's server (murmur simulate: 64)
SHUN_SECONDS = 60.0  # a node whose answer was too big is not asked for these keys for this long
MAX_SHUNNED = 1024  # nodes remembered as shunned; the oldest go first
# The longest a peer waits for one node's answer to a find or store of the run's records: a loopback answer takes ms,
# a replica 300 ms away on a connection already open about one round trip (the first contact, several: one
# that misses this waits out hivemind's 5 s ban and is asked again)
ANSWER_SECONDS = 1.5
_OVERSIZED: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("murmur_oversized", default=None)
_GUARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DHTProtocol -> its SybilGuard (in the worker)


@dataclass
class SybilGuard:
    """The rules for one node of `run_id`; `refused` counts store entries turned away, `dropped` answers too big
    and `late` answers to finds or stores not given in time."""

    run_id: str
    max_answer: int = MAX_ANSWER
    shun_seconds: float = SHUN_SECONDS
    answer_seconds: float = ANSWER_SECONDS
    refused: int = 0
    dropped: int = 0
    late: int = 0

    def __post_init__(self) -> None:
        self.keys = set(run_key_ids(self.run_id, ("peers", "metrics")))
        self._shunned: collections.OrderedDict[object, float] = collections.OrderedDict()  # node -> until

    def shun(self, node: object) -> None:
        self._shunned.pop(node, None)
        self._shunned[node] = time.monotonic() + self.shun_seconds
        while len(self._shunned) > MAX_SHUNNED:
            self._shunned.popitem(last=False)

    def skips(self, node: object, key: DHTID) -> bool:
        """Whether a reader leaves `key` out of what it asks `node` (shunned for an answer too big)."""
        if key.to_bytes() not in self.keys or (until := self._shunned.get(node)) is None:
            return False
        if time.monotonic() < until:
            return True
        del self._shunned[node]
        return False

    def admits(self, key: bytes, tag: bytes, sender: str) -> bool:
        """Whether a replica takes the store entry (`key`, `tag`: hivemind's packed subkey) from `sender`."""
        if key not in self.keys:
            return True
        if tag == DHTProtocol.IS_DICTIONARY:
            return False
        if tag == DHTProtocol.IS_REGULAR_VALUE:
            return True  # no subkey at all: the run's validator refuses it (a subkey must name the signer)
        try:
            return msgpack.unpackb(tag, raw=False) == sender
        except Exception:  # malformed msgpack raises many types
            return False

    def filter(self, request: dht_pb2.StoreRequest, sender: str) -> list[bool]:
        admitted = [self.admits(key, tag, sender) for key, tag in zip(request.keys, request.subkeys, strict=True)]
        self.refused += admitted.count(False)
        return admitted

    def waits_briefly(self, keys: list[DHTID]) -> bool:
        """Whether a peer waits `answer_seconds` at most, not hivemind's RPC timeout, for a node's answer to `keys`."""
        return any(key.to_bytes() in self.keys for key in keys)

    def too_big(self, key: bytes, value: object) -> bool:
        """Whether a reader drops one node's answer `value` (as hivemind decoded it) for `key`, unchecked."""
        return isinstance(value, DictionaryDHTValue) and key in self.keys and len(value) > self.max_answer


class _CopyOnRead:
    """A node's storage (hivemind's ``DHTLocalStorage``, which it wraps) whose ``get`` of the run's per-peer
    dictionaries returns a copy. Stores go to the real one; only readers see the copy: a traversal merges the
    answers it gets into the first value it holds (``_SearchState.add_candidate``), and the stored value must
    not be that one."""

    def __init__(self, storage, keys: set[bytes]) -> None:
        self._storage, self._keys = storage, keys

    def get(self, key: DHTID) -> ValueWithExpiration | None:
        found = self._storage.get(key)
        if found is None or not isinstance(found.value, DictionaryDHTValue) or key.to_bytes() not in self._keys:
            return found
        copy = DictionaryDHTValue()
        for subkey, (value, expiration) in found.value.items():
            copy.store(subkey, value, expiration)
        return ValueWithExpiration(copy, found.expiration_time)

    def __getattr__(self, name: str):
        return getattr(self._storage, name)


def _only(request: dht_pb2.StoreRequest, admitted: list[bool]) -> dht_pb2.StoreRequest:
    def kept(field) -> list:
        return [item for item, ok in zip(field, admitted, strict=True) if ok]

    return dht_pb2.StoreRequest(
        keys=kept(request.keys), subkeys=kept(request.subkeys), values=kept(request.values),
        expiration_time=kept(request.expiration_time), in_cache=kept(request.in_cache), peer=request.peer,
    )  # fmt: skip


async def install(run_id: str, _dht, node) -> None:
    """In the DHT worker (``dht.run_coroutine(partial(install, run_id))``): guard this node's reads, and its
    store handler unless it is a client-mode node, which serves no stores."""
    protocol = node.protocol
    if protocol in _GUARDS:
        return
    guard = _GUARDS[protocol] = SybilGuard(run_id)
    find, validate = protocol.call_find, protocol._validate_dictionary

    def checked(key: bytes, dictionary) -> bool:
        """hivemind's check of a dictionary found at one node, after the cap: an answer over it is refused before
        a single record of it is checked (a thousand fakes cost a reader a second of signature and address
        checks on its DHT loop, for every read that asked their server)."""
        if guard.too_big(key, dictionary):
            if (oversized := _OVERSIZED.get()) is not None:
                oversized.append(len(dictionary))
            return False
        return validate(key, dictionary)

    async def guarded_find(peer, keys):
        keys = list(keys)
        asked = [key for key in keys if not guard.skips(peer, key)]
        oversized: list[int] = []  # filled by `checked`, which hivemind's call_find calls in this task
        token = _OVERSIZED.set(oversized)
        try:
            if not asked:
                found = {}
            elif guard.waits_briefly(asked):
                found = await asyncio.wait_for(find(peer, asked), guard.answer_seconds)
            else:
                found = await find(peer, asked)
        except TimeoutError:  # hivemind's call_find answers None for its own timeout: this is ours
            guard.late += 1
            logger.debug("%s did not answer for run %r within %g s", peer, run_id, guard.answer_seconds)
            return None  # a failure: hivemind's traversals leave the node out for a while
        finally:
            _OVERSIZED.reset(token)
        if oversized:
            guard.dropped += len(oversized)
            guard.shun(peer)
            logger.debug("dropped %s's answer of %d records for run %r", peer, max(oversized), run_id)
        if found is None:
            return None
        return found | {key: (None, {}) for key in keys if key not in found}  # skipped: not found, no neighbours

    call_store = protocol.call_store

    async def guarded_call_store(peer, keys, values, expiration_time, subkeys=None, in_cache=None):
        """A store of the run's records waits `answer_seconds` at most, as a read does. hivemind bans a node only for
        a find it did not answer: one that answers finds at once and stores late held every announcement, and
        the heartbeat that makes it, that long, every time."""
        if not guard.waits_briefly(list(keys)):
            return await call_store(peer, keys, values, expiration_time, subkeys, in_cache)
        if peer in node.blacklist:  # its traversal leaves a banned node among the nearest, and stores on it
            return None
        try:
            return await asyncio.wait_for(call_store(peer, keys, values, expiration_time, subkeys, in_cache),
                                          guard.answer_seconds)  # fmt: skip
        except TimeoutError:
            guard.late += 1
            logger.debug("%s did not take a store for run %r within %g s", peer, run_id, guard.answer_seconds)
            node.blacklist.register_failure(peer)
            return None  # not stored there: hivemind asks the next nearest node

    # DHTNode's traversals and stores call these on the protocol; nothing else exposes one node's answer
    protocol.call_find, protocol._validate_dictionary = guarded_find, checked
    protocol.call_store = guarded_call_store
    protocol.storage = _CopyOnRead(protocol.storage, guard.keys)
    if protocol.client_mode:
        return
    store = protocol.rpc_store

    async def guarded_store(request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        if len(request.keys) != len(request.subkeys):
            return await store(request, context)  # hivemind refuses a misaligned request itself
        admitted = guard.filter(request, context.remote_id.to_base58())
        if all(admitted):
            return await store(request, context)
        logger.debug("refused %d records of run %r that %s stored for others", admitted.count(False), run_id,
                     context.remote_id)  # fmt: skip
        response = await store(_only(request, admitted), context)
        answers = iter(response.store_ok)
        merged = [next(answers, False) if ok else False for ok in admitted]
        del response.store_ok[:]
        response.store_ok.extend(merged)
        return response

    name = f"{DHTProtocol.__name__}.rpc_store"  # the name hivemind registers it under (ServicerBase)
    await protocol.p2p.remove_protobuf_handler(name)
    await protocol.p2p.add_protobuf_handler(name, guarded_store, dht_pb2.StoreRequest)


async def counts(_dht, node) -> dict[str, int]:
    """In the DHT worker: the store entries this node's guard refused, and the answers it dropped and gave up on."""
    guard = _GUARDS.get(node.protocol)
    if guard is None:
        return {"refused": 0, "dropped": 0, "late": 0}
    return {"refused": guard.refused, "dropped": guard.dropped, "late": guard.late}
