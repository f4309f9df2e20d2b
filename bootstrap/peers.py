"""The default bootstrap list shipped with the node (``bootstrap/peers.toml``)."""

from __future__ import annotations

import tomllib
from importlib import resources

from swarm.errors import ConfigError

EMPTY_LIST_HELP = (
    "no bootstrap peers: the bootstrap list shipped with this node is empty (the core team has"
    " not published its bootstrap peers yet) and the home's config.toml names none;"
    " pass --bootstrap /ip4/.../tcp/.../p2p/<peer id>"
)


def default_peers() -> list[str]:
    """The shipped list; ``ConfigError`` if the file is damaged."""
    text = resources.files("bootstrap").joinpath("peers.toml").read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the shipped bootstrap list is not valid TOML: {exc}") from exc
    peers = data.get("peers", [])
    if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
        raise ConfigError('the shipped bootstrap list must be `peers = ["/ip4/...", ...]`')
    return list(peers)
