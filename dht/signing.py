"""Signed, schema-checked records: nobody can forge or overwrite another peer's entries of a run.

Every value a node stores under one of the run's keys is signed with the node's libp2p identity
key (RSA, the key file that fixes its peer id), and every node of the run checks every such record
with `RunValidator`, both when it stores one for others and when it reads one:

* the signature (RSA-PSS over key, subkey, value and expiration, as hivemind's own
  ``RSASignatureValidator`` signs) must verify under the public key carried beside it, and the
  signer is the peer id that key hashes to (the libp2p rule), so a signature names a peer id;
* ``{run}:peers`` and ``{run}:metrics``: the subkey must be the signer's peer id, and the value a
  valid ``Announcement`` / ``Metrics`` of that peer (or a withdrawal tombstone);
* ``{run}:config``: a valid ``RunRecord`` whose ``created_by`` is the signer. A node started with the
  run's creator (the join line's ``--creator``; the creator's own node pins itself) accepts only that
  signer's config, so a stranger who publishes a config first is refused; a node started without
  one pins the first signer it accepts (trust on first use).
  Its signature covers only the record's content and travels inside it (``RunRecord.public_key``
  and ``signature``), so any peer can republish the creator's record unchanged, with a new
  expiration, to keep the config alive after the bootstrap node is gone.

Announcements and metrics travel as ``msgpack(value) + b"[murmur-sig:" + base64(msgpack([public_key,
signature])) + b"]"``; readers get the plain value back (``strip_value``). Nothing is unpickled.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import json
import logging
import re
from pathlib import Path

import msgpack
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from pydantic import ValidationError

from .records import Announcement, Metrics, RunRecord, validate_run_id

__all__ = ["RunValidator", "load_signing_key", "peer_id_of_public_key"]

logger = logging.getLogger(__name__)

_SIGNATURE = re.compile(rb"\[murmur-sig:([A-Za-z0-9+/=]{1,4096})\]\Z")
_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
_MAX_VALUE = 64 * 1024
_VERIFIED = 8192  # announcements and metrics remembered as verified (sha256 of what is signed), newest kept
# how far ahead a record may expire (its ttl, plus room for clock skew): a fake announcement cannot outlive its
# signer's attention for an hour with one store, nor a stale one shadow a newer state for long
_MAX_TTL = {"peers": 300.0, "metrics": 600.0, "config": 4 * 3600.0}
_IS_REGULAR_VALUE = msgpack.packb(None)  # hivemind's subkey tag for a value without subkeys


class _Invalid(ValueError):
    pass


def load_signing_key(identity_path: str | Path) -> rsa.RSAPrivateKey:
    """The RSA private key inside a libp2p identity file (see dht.identity)."""
    data = Path(identity_path).read_bytes()
    key = serialization.load_der_private_key(crypto_pb2.PrivateKey.FromString(data).data, password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"identity file {str(identity_path)!r} does not hold an RSA key")
    return key


def _public_der(key: rsa.RSAPrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def peer_id_of_public_key(der: bytes) -> str:
    """The libp2p peer id of an RSA public key (DER SubjectPublicKeyInfo), as PeerID.from_identity derives it."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def run_key_ids(run_id: str, kinds: tuple[str, ...] = ("peers", "metrics", "config")) -> dict[bytes, str]:
    """The DHT ids of a run's keys (``{run_id}:{kind}``), each mapped to its kind."""
    return {DHTID.generate(source=f"{run_id}:{kind}").to_bytes(): kind for kind in kinds}


def _config_payload(body: dict) -> bytes:
    """What the creator signs: the config's content, in a canonical form (not its expiration)."""
    content = {k: body.get(k) for k in ("run_id", "config", "created_by")}
    if body.get("secret_check") is not None:  # a private run: stripping the mark breaks the signature
        content["secret_check"] = body["secret_check"]
    return json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


def _payload(record: DHTRecord, value: bytes) -> bytes:
    return msgpack.packb([record.key, record.subkey, value, record.expiration_time])


class RunValidator(RecordValidatorBase):
    """Signs this node's records of `run_id` and checks everyone's (see the module docstring)."""

    def __init__(self, run_id: str, private_key: rsa.RSAPrivateKey | None, creator: str | None = None) -> None:
        """`creator`: the peer id the run's join line names (`--creator`), or "self" on the creator's own node;
        then only that signer's config is accepted, from the start. Without it, the first valid config
        this node sees pins its signer (trust on first use)."""
        self.run_id = validate_run_id(run_id)
        self._key = private_key
        self._public = None if private_key is None else _public_der(private_key)
        if creator == "self":
            if self._public is None:
                raise ValueError("creator 'self' needs this node's signing key")
            creator = peer_id_of_public_key(self._public)
        self._kinds = run_key_ids(run_id)
        self._verified: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # digests checked
        self._creator: str | None = creator  # the config's signer: given, or pinned on the first valid config

    @property
    def priority(self) -> int:
        return 10  # before validators that deserialize the value, like hivemind's RSASignatureValidator

    def sign_value(self, record: DHTRecord) -> bytes:
        kind = self._kinds.get(record.key)
        if kind is None or self._key is None:
            return record.value
        if kind == "config":
            return self._sign_config(record.value)
        signature = self._key.sign(_payload(record, record.value), _PADDING, hashes.SHA256())
        envelope = base64.b64encode(msgpack.packb([self._public, signature]))
        return record.value + b"[murmur-sig:" + envelope + b"]"

    def _sign_config(self, value: bytes) -> bytes:
        """Our own config gets our signature inside it; anyone else's (a republish) is left as it is."""
        body = msgpack.unpackb(value, raw=False)
        if not isinstance(body, dict) or body.get("signature") is not None:
            return value
        if body.get("created_by") != peer_id_of_public_key(self._public):
            return value
        signature = self._key.sign(_config_payload(body), _PADDING, hashes.SHA256())
        body["public_key"] = base64.b64encode(self._public).decode()
        body["signature"] = base64.b64encode(signature).decode()
        return msgpack.packb(body)

    def strip_value(self, record: DHTRecord) -> bytes:
        if self._kinds.get(record.key) in (None, "config"):
            return record.value
        return _SIGNATURE.sub(b"", record.value)

    def validate(self, record: DHTRecord) -> bool:
        kind = self._kinds.get(record.key)
        if kind is None:
            return True  # not this run's record
        try:
            self._check(kind, record)
        except _Invalid as e:
            logger.debug("refusing a %s record of run %r: %s", kind, self.run_id, e)
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RunValidator) and other.run_id == self.run_id

    def _check(self, kind: str, record: DHTRecord) -> None:
        if len(record.value) > _MAX_VALUE:
            raise _Invalid(f"value of {len(record.value)} bytes")
        if (ahead := record.expiration_time - get_dht_time()) > _MAX_TTL[kind]:
            raise _Invalid(f"it expires {ahead:.0f} s from now, more than {_MAX_TTL[kind]:.0f} s")
        if kind == "config":
            self._check_config(record)
            return
        digest = hashlib.sha256(_payload(record, record.value)).digest()
        if digest in self._verified:  # the same record, already checked (hivemind validates every read)
            self._verified.move_to_end(digest)
            return
        match = _SIGNATURE.search(record.value)
        if match is None:
            raise _Invalid("unsigned")
        value = record.value[: match.start()]
        try:
            public, signature = msgpack.unpackb(base64.b64decode(match.group(1)), raw=False, max_bin_len=4096)
            key = serialization.load_der_public_key(public)
            if not isinstance(key, rsa.RSAPublicKey):
                raise _Invalid("the signing key is not RSA")
            key.verify(signature, _payload(record, value), _PADDING, hashes.SHA256())
            body = msgpack.unpackb(value, raw=False, max_bin_len=0, max_ext_len=0)
        except (InvalidSignature, binascii.Error, TypeError):
            raise _Invalid("bad signature") from None
        except _Invalid:
            raise
        except Exception as e:  # msgpack and cryptography raise many types on malformed input
            raise _Invalid(f"malformed envelope ({type(e).__name__})") from None
        signer = peer_id_of_public_key(public)
        subkey = None if record.subkey == _IS_REGULAR_VALUE else msgpack.unpackb(record.subkey, raw=False)
        if subkey != signer:
            raise _Invalid(f"subkey {subkey!r} is not the signer {signer}")
        if body is not None:  # None: the peer withdrew its own entry
            model: type[Announcement | Metrics] = Announcement if kind == "peers" else Metrics
            if _validated(model, body).peer_id != signer:
                raise _Invalid(f"the {kind} record names another peer than its signer {signer}")
        self._verified[digest] = None
        while len(self._verified) > _VERIFIED:
            self._verified.popitem(last=False)

    def _check_config(self, record: DHTRecord) -> None:
        if record.subkey != _IS_REGULAR_VALUE:
            raise _Invalid("the config has no subkeys")
        try:
            body = msgpack.unpackb(record.value, raw=False, max_bin_len=0, max_ext_len=0)
        except Exception as e:  # msgpack raises many types on malformed input
            raise _Invalid(f"malformed config ({type(e).__name__})") from None
        config = _validated(RunRecord, body)
        if config.public_key is None or config.signature is None:
            raise _Invalid("unsigned config")
        try:
            public = base64.b64decode(config.public_key, validate=True)
            key = serialization.load_der_public_key(public)
            if not isinstance(key, rsa.RSAPublicKey):
                raise _Invalid("the signing key is not RSA")
            key.verify(
                base64.b64decode(config.signature, validate=True), _config_payload(body), _PADDING, hashes.SHA256()
            )
        except _Invalid:
            raise
        except Exception:  # binascii, cryptography: a bad key or signature
            raise _Invalid("bad config signature") from None
        signer = peer_id_of_public_key(public)
        if config.run_id != self.run_id or config.created_by != signer:
            raise _Invalid(f"config of run {config.run_id!r} by {config.created_by} signed by {signer}")
        if self._creator is None:
            self._creator = signer
        elif self._creator != signer:
            raise _Invalid(f"the run's config was created by {self._creator}, not {signer}")


def _validated(model: type[Announcement | Metrics | RunRecord], body: object):
    try:
        return model.decode(body)
    except ValidationError as e:
        raise _Invalid(f"not a valid {model.__name__}: {e.error_count()} errors") from None
