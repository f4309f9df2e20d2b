"""A node's home folder: its key, its config, its lock, and everything it stores.

Layout::

    <home>/node.key       Ed25519 key, PKCS#8 PEM, mode 0600 (optionally passphrase-encrypted)
    <home>/config.toml    listen addresses, bootstrap list, metrics port
    <home>/node.lock      held by the running node; a second node on the same home refuses
    <home>/runs/<run>/adverts-issued
                          issue times of the node's last adverts (how a restarted node tells
                          its own previous life from another node running with its key)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from swarm.errors import ConfigError, KeyExistsError, StorageError, WrongPassphraseError
from swarm.identity import NodeKey, load_key, write_key

ENV_HOME = "SWARM_NODE_HOME"
ENV_PASSPHRASE = "SWARM_NODE_PASSPHRASE"
DEFAULT_LISTEN = ("/ip4/0.0.0.0/tcp/4001",)
ADVERTS_ISSUED = "adverts-issued"
KEEP_ISSUED = 16
"""Adverts live ``advert_ttl_s`` and are refreshed every third of it: the last 16 cover any
advert of a previous life still live in the DHT."""


def default_home() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "swarm-node"


def resolve_home(path: Path | None = None) -> Path:
    """The home to use: the ``--home`` flag, else ``$SWARM_NODE_HOME``, else the default."""
    if path is not None:
        return path.expanduser()
    env = os.environ.get(ENV_HOME)
    return Path(env).expanduser() if env else default_home()


def passphrase_from_env() -> bytes | None:
    value = os.environ.get(ENV_PASSPHRASE)
    return value.encode() if value else None


def _int_or_none(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """What ``config.toml`` holds. Command-line flags override it per run."""

    listen: tuple[str, ...] = DEFAULT_LISTEN
    bootstrap: tuple[str, ...] = ()
    metrics_port: int = 0
    announce: tuple[str, ...] = ()
    """Addresses to advertise first (a forwarded port on the router, a public IP)."""
    conn_low: int | None = None
    conn_high: int | None = None
    """Connection water marks; None: the role's (``swarm.net.connections.bounds_for``)."""

    def to_toml(self) -> dict[str, object]:
        return {
            "node": {
                "listen": list(self.listen),
                "bootstrap": list(self.bootstrap),
                "metrics_port": self.metrics_port,
                "announce": list(self.announce),
                **({"conn_low": self.conn_low} if self.conn_low is not None else {}),
                **({"conn_high": self.conn_high} if self.conn_high is not None else {}),
            }
        }

    @classmethod
    def from_toml(cls, data: dict[str, object], source: Path) -> NodeConfig:
        section = data.get("node", {})
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: [node] must be a table")
        try:
            listen = tuple(str(a) for a in section.get("listen", DEFAULT_LISTEN))
            bootstrap = tuple(str(a) for a in section.get("bootstrap", ()))
            metrics_port = int(section.get("metrics_port", 0))
            announce = tuple(str(a) for a in section.get("announce", ()))
            conn_low = _int_or_none(section.get("conn_low"))
            conn_high = _int_or_none(section.get("conn_high"))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {exc}") from exc
        return cls(
            listen=listen,
            bootstrap=bootstrap,
            metrics_port=metrics_port,
            announce=announce,
            conn_low=conn_low,
            conn_high=conn_high,
        )


@dataclass(frozen=True, slots=True)
class NodeHome:
    path: Path
    _prompt: Callable[[], str] | None = field(default=None, compare=False)

    @property
    def key_path(self) -> Path:
        return self.path / "node.key"

    @property
    def config_path(self) -> Path:
        return self.path / "config.toml"

    @property
    def lock_path(self) -> Path:
        return self.path / "node.lock"

    def run_dir(self, run_id: str) -> Path:
        """Where a run's data lives: ledger, evidence, shards, trainer state."""
        return self.path / "runs" / run_id

    def adverts_issued(self, run_id: str) -> list[int]:
        """The issue times (ms) of the adverts this home's node published in ``run_id``, newest
        last: a live advert with one of them is this node's previous life, not a twin."""
        try:
            text = (self.run_dir(run_id) / ADVERTS_ISSUED).read_text()
            return [int(line) for line in text.split()]
        except (OSError, ValueError):  # none yet, or a torn file: no previous life known
            return []

    def note_advert_issued(self, run_id: str, issued_at: int) -> None:
        """Remember one more advert's issue time (the last ``KEEP_ISSUED``), atomically."""
        path = self.run_dir(run_id) / ADVERTS_ISSUED
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [*self.adverts_issued(run_id), issued_at][-KEEP_ISSUED:]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{value}\n" for value in kept))
        tmp.replace(path)

    def has_key(self) -> bool:
        return self.key_path.exists()

    def create(
        self, passphrase: bytes | None = None, *, force: bool = False
    ) -> tuple[NodeKey, Path | None]:
        """Create the key and a default config. Returns the key and where an old key was moved.

        Never deletes a key: without ``force`` an existing key raises ``KeyExistsError``; with
        ``force`` it is renamed to ``node.key.replaced-<unix time>`` first.
        """
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        moved: Path | None = None
        if self.has_key():
            if not force:
                raise KeyExistsError(
                    f"a key already exists at {self.key_path}; it was not overwritten"
                    " (use --force to move it aside and create a new one)"
                )
            moved = self.key_path.with_name(f"node.key.replaced-{int(time.time())}")
            self.key_path.rename(moved)
        key = NodeKey.generate()
        write_key(key, self.key_path, passphrase)
        if not self.config_path.exists():
            self.save_config(NodeConfig())
        return key, moved

    def load_key(self) -> NodeKey:
        """Load the key; an encrypted one takes ``$SWARM_NODE_PASSPHRASE`` or asks the prompt."""
        passphrase = passphrase_from_env()
        try:
            return load_key(self.key_path, passphrase)
        except WrongPassphraseError:
            if passphrase is not None or self._prompt is None:
                raise
        return load_key(self.key_path, self._prompt().encode())

    def load_config(self) -> NodeConfig:
        if not self.config_path.exists():
            return NodeConfig()
        try:
            data = tomllib.loads(self.config_path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{self.config_path} is not valid TOML: {exc}") from exc
        return NodeConfig.from_toml(data, self.config_path)

    def save_config(self, config: NodeConfig) -> None:
        tmp = self.config_path.with_suffix(".toml.tmp")
        tmp.write_text(tomli_w.dumps(config.to_toml()))
        tmp.replace(self.config_path)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the home's lock for the life of a node; ``StorageError`` if another holds it."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise StorageError(
                    f"another swarm-node is running with home {self.path} (pid {holder});"
                    " stop it or pass a different --home"
                ) from exc
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # closing releases the flock
