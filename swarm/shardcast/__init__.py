"""SHARDCAST: moving policy weights from the trainer to every node, as fast as the wire allows.

- ``publish``: cut a safetensors checkpoint into shards and sign the ``ShardManifest``;
- ``store``: versions on disk (preallocated data, a crash-safe verified journal, retention);
- ``peers``: provider choice by measured throughput and success;
- ``source``: what the scheduler drives (``ShardSource``, ``ShardSink``);
- ``manifest``: verifying a manifest against the genesis before any shard is fetched, and
  carrying a small one in the announcement;
- ``fetch``: the scheduler that pulls shards from many providers through a ``ShardSource``;
- ``datachannel``: the zero-copy plain-TCP channel for shard bytes;
- ``serve``: answering manifest, have and shard requests from the store.
"""

from __future__ import annotations

from swarm.shardcast.fetch import FetchConfig, FetchProgress, FetchResult, fetch_version
from swarm.shardcast.manifest import (
    announced_manifest,
    fetch_manifest,
    inline_manifest,
    verify_manifest,
)
from swarm.shardcast.peers import PeerBoard, PeerStats
from swarm.shardcast.publish import (
    DEFAULT_SHARD_SIZE,
    check_safetensors,
    cut,
    publish,
    publish_version,
)
from swarm.shardcast.source import ShardNotHeld, ShardSink, ShardSource
from swarm.shardcast.store import ShardStore, VersionFile, VersionInfo

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "FetchConfig",
    "FetchProgress",
    "FetchResult",
    "PeerBoard",
    "PeerStats",
    "ShardNotHeld",
    "ShardSink",
    "ShardSource",
    "ShardStore",
    "VersionFile",
    "VersionInfo",
    "announced_manifest",
    "check_safetensors",
    "cut",
    "fetch_manifest",
    "fetch_version",
    "inline_manifest",
    "publish",
    "publish_version",
    "verify_manifest",
]
