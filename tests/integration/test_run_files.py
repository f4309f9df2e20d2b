"""The run-files protocol between real hosts on 127.0.0.1: a file larger than one answer arrives
in chunks and is kept only when its sha256 matches; a peer serving other bytes is skipped; a
request for a file not held, or a malformed one, is refused."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgpack
import pytest

from node.run_files import (
    CHUNK,
    RUN_FILES,
    RUN_FILES_LIMITS,
    RunFileServer,
    fetch_file,
    file_request,
)
from swarm.errors import MalformedError, PeerError
from swarm.messages import FileRef
from tests.netfactory import NetFactory, wait_until


def ref_of(path: Path) -> FileRef:
    data = path.read_bytes()
    return FileRef(path.name, hashlib.sha256(data).digest(), len(data))


async def test_a_large_file_arrives_in_chunks_and_a_lying_peer_is_skipped(tmp_path: Path) -> None:
    good = tmp_path / "good" / "tokenizer.json"
    good.parent.mkdir()
    good.write_bytes(os.urandom(CHUNK + 12345))  # two answers
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_bytes(os.urandom(good.stat().st_size))
    ref = ref_of(good)
    async with NetFactory() as net:
        await net.bootstrap()
        liar = await net.node("trainer")  # trainers are asked first: this one lies
        honest = await net.node("validator")
        fetcher = await net.node("inference")
        lying = RunFileServer()
        lying.add(ref, bad)  # claims the file, serves other bytes
        liar.handle(RUN_FILES, lying.handle, RUN_FILES_LIMITS)
        serving = RunFileServer()
        serving.add(ref, good)
        honest.handle(RUN_FILES, serving.handle, RUN_FILES_LIMITS)
        await wait_until(
            lambda: (
                {"trainer", "validator"} <= {r for r, ps in fetcher.peers_by_role().items() if ps}
            ),
            30,
        )
        dest = tmp_path / "cache" / "tokenizer.json"
        await fetch_file(fetcher, ref, dest, give_up_after=10)
        assert dest.read_bytes() == good.read_bytes()
        assert lying.served_bytes == ref.size and serving.served_bytes == ref.size
        assert not dest.with_name("tokenizer.json.part").exists()

        missing = FileRef("gone.json", b"\x01" * 32, 10)
        with pytest.raises(PeerError, match=r"no peer served run file gone.json"):
            await fetch_file(fetcher, missing, tmp_path / "cache" / "gone.json", give_up_after=0.5)


async def test_requests_for_files_not_held_or_malformed_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{}")
    server = RunFileServer()
    ref = ref_of(path)
    server.add(ref, path)
    assert await server.handle("peer", file_request(ref.sha256, 0)) == b"{}"
    with pytest.raises(PeerError, match="not held here"):
        await server.handle("peer", file_request(b"\x02" * 32, 0))
    with pytest.raises(MalformedError, match="past the end"):
        await server.handle("peer", file_request(ref.sha256, 2))
    for body in (
        b"\xc1",
        msgpack.packb({"sha256": b"short", "offset": 0}),
        msgpack.packb({"sha256": ref.sha256, "offset": -1}),
        msgpack.packb({"sha256": ref.sha256}),
        msgpack.packb([1, 2]),
    ):
        with pytest.raises(MalformedError):
            await server.handle("peer", body)
