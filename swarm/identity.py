"""Node identity: an Ed25519 key, its libp2p peer ID, and the key file on disk.

The peer that sends a message and the key that signs it are the same thing: the peer ID is the
libp2p identity multihash of the protobuf-encoded public key, exactly what py-libp2p derives
(``tests/unit/test_identity.py`` checks it against ``libp2p.peer.id.ID.from_pubkey``). We compute
it here rather than through libp2p so that the wire layer stays importable without the network
stack.

Key file: PKCS#8 PEM, optionally encrypted with a passphrase, mode 0600. Loading refuses a file
readable by group or others, because whoever reads it can sign as this node.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import base58
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarm.errors import (
    KeyCorruptError,
    KeyExistsError,
    KeyFileError,
    KeyPermissionError,
    MalformedError,
    WrongPassphraseError,
)
from swarm.wire import signing_input

# libp2p's crypto.proto: PublicKey { KeyType Type = 1; bytes Data = 2; }, Ed25519 = 1.
_PB_ED25519_PREFIX: Final = bytes([0x08, 0x01, 0x12, 0x20])
_MULTIHASH_IDENTITY: Final = 0x00


@functools.lru_cache(maxsize=4096)
def peer_id_from_public(public: bytes) -> str:
    """The base58 libp2p peer ID ("12D3KooW...") of a raw 32-byte Ed25519 public key.

    Cached: base58 costs ~60 us, and the same few signers (validators, trainers) sign most of
    what a node decodes (``Signed.signer`` calls this on every access)."""
    if len(public) != 32:
        raise MalformedError(f"an Ed25519 public key is 32 bytes, got {len(public)}")
    encoded = _PB_ED25519_PREFIX + public
    multihash = bytes([_MULTIHASH_IDENTITY, len(encoded)]) + encoded
    return base58.b58encode(multihash).decode()


def public_from_peer_id(peer_id: str) -> bytes:
    """The raw Ed25519 public key inside a peer ID; ``MalformedError`` for anything else."""
    try:
        multihash = base58.b58decode(peer_id)
    except ValueError as exc:
        raise MalformedError(f"{peer_id[:60]!r} is not a base58 peer ID") from exc
    prefix = bytes([_MULTIHASH_IDENTITY, 36]) + _PB_ED25519_PREFIX
    if len(multihash) != len(prefix) + 32 or not multihash.startswith(prefix):
        raise MalformedError(f"{peer_id[:60]!r} is not the peer ID of an Ed25519 key")
    return multihash[len(prefix) :]


@dataclass(frozen=True, slots=True)
class NodeKey:
    """A node's signing key. ``peer_id`` is its identity on the network and in the ledger."""

    private: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> NodeKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> NodeKey:
        """A deterministic key from 32 seed bytes (tests and reproducible demos only)."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def public(self) -> bytes:
        return self.private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def seed(self) -> bytes:
        """The 32 raw private bytes (what libp2p's Ed25519 key is built from)."""
        return self.private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    @property
    def peer_id(self) -> str:
        return peer_id_from_public(self.public)

    def signature(self, kind: str, payload: bytes) -> bytes:
        """The Ed25519 signature of ``payload`` as an object of ``kind`` (domain-separated)."""
        return self.private.sign(signing_input(kind, payload))

    def to_pem(self, passphrase: bytes | None = None) -> bytes:
        encryption: serialization.KeySerializationEncryption = (
            serialization.BestAvailableEncryption(passphrase)
            if passphrase
            else serialization.NoEncryption()
        )
        return self.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
        )


def write_key(key: NodeKey, path: Path, passphrase: bytes | None = None) -> None:
    """Write a new key file with mode 0600. Never overwrites: ``KeyExistsError`` if it exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise KeyExistsError(f"a key already exists at {path}; it was not overwritten") from exc
    except OSError as exc:
        raise KeyFileError(f"cannot create key file {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(key.to_pem(passphrase))
        f.flush()
        os.fsync(f.fileno())


def load_key(path: Path, passphrase: bytes | None = None) -> NodeKey:
    """Load a key file, refusing one that others can read or that does not parse."""
    try:
        st = path.stat()
    except FileNotFoundError as exc:
        raise KeyFileError(f"no key at {path}; run `swarm-node init` first") from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyPermissionError(
            f"key file {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o});"
            f" run `chmod 600 {path}`"
        )
    data = path.read_bytes()
    try:
        private = serialization.load_pem_private_key(data, password=passphrase or None)
    except TypeError as exc:
        if passphrase:
            raise KeyCorruptError(
                f"key file {path} is not encrypted but a passphrase was given"
            ) from exc
        raise WrongPassphraseError(
            f"key file {path} is encrypted; give its passphrase (prompt or SWARM_NODE_PASSPHRASE)"
        ) from exc
    except ValueError as exc:
        if b"ENCRYPTED" in data:
            raise WrongPassphraseError(f"wrong passphrase for key file {path}") from exc
        raise KeyCorruptError(f"key file {path} does not hold a key we can read") from exc
    except Exception as exc:  # cryptography raises several internal types for garbage input
        raise KeyCorruptError(f"key file {path} does not hold a key we can read") from exc
    if not isinstance(private, Ed25519PrivateKey):
        raise KeyCorruptError(f"key file {path} holds a {type(private).__name__}, not Ed25519")
    return NodeKey(private)
