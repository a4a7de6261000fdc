"""A persistent identity: the private key file that fixes a peer's libp2p peer id across restarts.

The file holds a libp2p ``PrivateKey`` protobuf with an RSA key, the format hivemind's
``P2P.generate_identity`` writes and ``P2P.create(identity_path=...)`` reads.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2

from .errors import one_line

__all__ = ["IdentityError", "ensure_identity", "peer_id_of"]

_MAX_KEY_BYTES = 64 * 1024


class IdentityError(ValueError):
    """The identity file is missing, unreadable or not a key hivemind can use. ``str(e)`` is one line."""


def _load_peer_id(path: Path) -> PeerID:
    """The peer id of the key in ``path``; IdentityError if the file is not a usable key."""
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_KEY_BYTES + 1)
    except OSError as e:
        raise IdentityError(f"identity file {str(path)!r} cannot be read: {e.strerror or e}") from e
    if not data:
        raise IdentityError(f"identity file {str(path)!r} is empty")
    if len(data) > _MAX_KEY_BYTES:
        raise IdentityError(f"identity file {str(path)!r} is larger than {_MAX_KEY_BYTES} bytes")
    try:
        key_type = crypto_pb2.PrivateKey.FromString(data).key_type
        if key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"key type {key_type} is not RSA")
        return PeerID.from_identity(data)
    except Exception as e:  # protobuf and cryptography each raise their own types
        reason = one_line(e)
        raise IdentityError(f"identity file {str(path)!r} is not a libp2p RSA private key: {reason}") from e


def ensure_identity(path: str | os.PathLike[str]) -> Path:
    """Create the key file (and its folder) if missing, else check that it holds a usable key.

    Creation never overwrites: the key is written to a temporary file and hard-linked into place,
    so two processes racing on one path end up sharing whichever key landed first.
    """
    path = Path(path)
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            P2P.generate_identity(str(tmp))
            os.link(tmp, path)
        except FileExistsError as e:
            if e.filename2 is None:  # the folder is a file (os.link's: another process's key landed first)
                raise IdentityError(f"identity file {str(path)!r} cannot be created in {str(path.parent)!r}: "
                                    f"{e.strerror}") from e  # fmt: skip
        except OSError as e:  # a read-only or missing folder: named as the identity's, not as some path's
            raise IdentityError(f"identity file {str(path)!r} cannot be created in {str(path.parent)!r}: "
                                f"{e.strerror or e}") from e  # fmt: skip
        finally:
            with contextlib.suppress(OSError):  # never made (its folder read-only, or a file)
                tmp.unlink()
    if not path.is_file():
        raise IdentityError(f"identity path {str(path)!r} is not a regular file")
    _load_peer_id(path)
    return path


def peer_id_of(path: str | os.PathLike[str]) -> str:
    """The base58 peer id that the key file yields, derived from the key without starting p2pd."""
    return _load_peer_id(Path(path)).to_base58()
