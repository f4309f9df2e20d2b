"""One error tree for everything the protocol library raises.

Lower-layer errors (msgpack, cryptography, libp2p, OS errors) are translated into these at the
boundary where they happen, so callers catch ``SwarmError`` and never a third-party type. Every
message says what happened and, where a user can act, what to do next.

::

    SwarmError
    ├── WireError                 bytes that are not a valid object of our wire format
    │   ├── MalformedError        truncated, not msgpack, wrong shape or field types
    │   ├── OversizeError         larger than the kind's size limit
    │   ├── NonCanonicalError     a signed payload not in canonical encoding
    │   └── UnknownKindError      an envelope kind this software does not know
    ├── SignatureError            a signature that does not verify (or a kind that was swapped)
    ├── KeyFileError              the node's key file cannot be used
    │   ├── KeyPermissionError    readable by group or others
    │   ├── KeyCorruptError       not a key we can parse
    │   ├── WrongPassphraseError  encrypted, and the passphrase is missing or wrong
    │   └── KeyExistsError        init would overwrite an existing key
    ├── ConfigError               bad configuration, arguments or files given by a user
    ├── ValidationError           a well-formed, signed object that the run's rules refuse
    │   ├── NotAuthorizedError    signed by a key without the role it claims
    │   └── EvidenceMissingError  cites an object (a verdict) not held here yet
    ├── ProofError                a proof that cannot be built or checked (shapes, encodings)
    ├── EngineError               the compute child failed, crashed or answered nonsense
    ├── StorageError              local storage failed (disk full, corrupt database, lock held)
    └── NetworkError              peers, dials, streams
        ├── BootstrapError        no bootstrap peer could be reached
        ├── PeerError             a peer misbehaved (bad answer, over budget, wrong peer ID)
        └── RequestTimeout        a request got no answer in time
"""

from __future__ import annotations


class SwarmError(Exception):
    """Root of every error this project raises on purpose."""


class WireError(SwarmError):
    """Bytes that are not a valid object of the wire format."""


class MalformedError(WireError):
    """Truncated bytes, not msgpack, or a field of the wrong shape or type."""


class OversizeError(WireError):
    """An object larger than its kind's size limit."""


class NonCanonicalError(WireError):
    """A signed payload that is not in canonical encoding (ids must be unique)."""


class UnknownKindError(WireError):
    """An envelope kind this software does not know."""


class SignatureError(SwarmError):
    """A signature that does not verify for the signer, kind and payload it claims."""


class KeyFileError(SwarmError):
    """The node's key file cannot be used."""


class KeyPermissionError(KeyFileError):
    """The key file is readable by group or others."""


class KeyCorruptError(KeyFileError):
    """The key file does not hold a key we can parse."""


class WrongPassphraseError(KeyFileError):
    """The key file is encrypted and the passphrase is missing or wrong."""


class KeyExistsError(KeyFileError):
    """Creating a key would overwrite an existing one."""


class ConfigError(SwarmError):
    """Configuration, arguments or input files that cannot be used as given."""


class ValidationError(SwarmError):
    """A well-formed, correctly signed object that the run's rules refuse."""


class NotAuthorizedError(ValidationError):
    """Signed by a key that does not hold the role the object needs."""


class EvidenceMissingError(ValidationError):
    """A signed object that cites evidence not held here (yet): kept pending, not refused.
    ``missing`` is the id of the object it waits for."""

    def __init__(self, message: str, missing: bytes = b"") -> None:
        super().__init__(message)
        self.missing = missing


class ProofError(SwarmError):
    """A proof that cannot be built or checked (wrong shapes or encodings)."""


class EngineError(SwarmError):
    """The compute engine failed, its child process died, or it answered nonsense."""


class StorageError(SwarmError):
    """Local storage failed: disk full, a corrupt database, a lock held by another process."""


class NetworkError(SwarmError):
    """Something between peers failed."""


class BootstrapError(NetworkError):
    """No bootstrap peer could be reached."""


class PeerError(NetworkError):
    """A peer misbehaved: a bad answer, over its failure budget, or the wrong peer ID."""


class PeerUnreachable(NetworkError):
    """No stream to the peer could be opened: it is gone, or a connection cap (ours or its
    own) refused the dial for the moment."""


class RequestTimeout(NetworkError):
    """A request got no answer within its deadline."""
