"""A version of several files (a sharded checkpoint): each file split out of the version's bytes.

SHARDCAST moves a version as one run of bytes (``data``, every file at its manifest offset), so
shards land at their offset with no reassembly. Loaders want the files themselves (a Hugging
Face directory with ``model.safetensors.index.json``), so a complete version of several files is
split into ``files/<name>`` once, by the kernel (``os.copy_file_range``: no bytes pass through
Python, and on a filesystem with reflinks the copy shares the blocks). ``files/.complete``
marks a finished split; an interrupted one is redone from the start.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from swarm.messages import ShardManifest
from swarm.shardcast.store import _fsync_dir, _os_error


def split_files(directory: Path, manifest: ShardManifest) -> Path:
    """Split ``directory/data`` into ``directory/files/<name>`` by ``manifest.files``."""
    out = directory / "files"
    if (out / ".complete").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    try:
        out.mkdir()
        with open(directory / "data", "rb") as data:
            for f in manifest.files:
                target = out / f.path
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as dst:
                    offset, left = f.offset, f.size
                    while left > 0:
                        n = os.copy_file_range(data.fileno(), dst.fileno(), left, offset)
                        if n == 0:
                            raise OSError(f"{directory / 'data'} ended at byte {offset}")
                        offset += n
                        left -= n
                    os.fsync(dst.fileno())
        (out / ".complete").touch()
        _fsync_dir(out)
    except OSError as exc:
        shutil.rmtree(out, ignore_errors=True)
        raise _os_error(
            "splitting the version into its files", out, exc, manifest.total_size
        ) from exc
    return out
