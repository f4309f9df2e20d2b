"""Fuzz targets that need a running swarm: the stream handlers of real nodes, fed through real
libp2p streams, and the admin socket.

``LiveSwarm`` runs a trainer (policy v0 published), a validator (in-process engine), mallory
(the fuzzer, with a home, so it has an admin socket) and an honest peer, in one trio run on a
background thread, so hypothesis can drive it case by case from ordinary test code. Every
server's handler is wrapped: an exception that is not a ``SwarmError`` is recorded, so a case
is "untyped" exactly when a handler let one escape (the stream layer would hide it as a reset).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, suppress
from pathlib import Path
from typing import Any

import msgpack
import trio
from hypothesis import strategies as st

from node import admin
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.roles.launch import RoleHandle, launch
from node.run_files import file_request
from node.runtime import Node
from swarm.errors import PeerError, SwarmError
from swarm.messages import (
    FileRef,
    PolicyAnnouncement,
    RolloutSubmission,
    Sample,
    ShardManifest,
    Verdict,
    decode,
    sign,
)
from swarm.net import StreamLimits
from swarm.shardcast.protocol import Holdings, ManifestRequest, ShardRequest
from tests.fuzz.inputs import pack
from tests.fuzz.targets import PROOF, Target, resigned
from tests.netfactory import NetFactory, key_named, wait_until

FUZZ_LIMITS = StreamLimits(max_request=1 << 20, max_response=8 << 20, timeout=20.0)
HANDLERS = ("submit", "samples", "policy", "ledger-sync", "manifest", "shard", "run-files")


class LiveSwarm:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.untyped: dict[str, list[str]] = {name: [] for name in (*HANDLERS, "admin")}
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, daemon=True)
        self.trainer: Node
        self.validator: Node
        self.mallory: Node
        self.honest: Node
        self.roles: dict[str, RoleHandle] = {}

    # --- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> LiveSwarm:
        self._thread.start()
        if not self._ready.wait(180) or self._error is not None:
            self.close()
            raise RuntimeError(f"the fuzz swarm did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._token is not None and self._stop is not None:
            with suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(60)

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with NetFactory(home_root=self.root) as net, AsyncExitStack() as stack:

            def engine() -> TorchEngine:
                return TorchEngine.from_dir(DEFAULT_MODEL_DIR)

            self.trainer = await net.node("trainer", bootstrap=[], home=True)
            addr = self.trainer.overlay.addrs()[:1]
            self.roles["trainer"] = await stack.enter_async_context(
                launch(self.trainer, self.root / "t", max_versions=0, ledger_sync_every_s=3600)
            )
            self.validator = await net.node("validator", bootstrap=addr, home=True)
            self.roles["validator"] = await stack.enter_async_context(
                launch(
                    self.validator, self.root / "v", engine_factory=engine, ledger_sync_every_s=3600
                )
            )
            self.mallory = await net.node(
                "inference", key_named("mallory"), bootstrap=addr, home=True
            )
            self.honest = await net.node("inference", key_named("honest"), bootstrap=addr)
            await wait_until(lambda: self.trainer.policy.newest is not None, 120)
            await wait_until(lambda: "submit" in self.validator.servers, 120)
            for node, name in [
                (self.validator, "submit"),
                *((self.trainer, n) for n in HANDLERS[1:]),
            ]:
                self._record(node, name)
            self._ready.set()
            await self._stop.wait()

    def _record(self, node: Node, name: str) -> None:
        server = node.servers[name]
        inner = server.handler
        log = self.untyped[name]

        async def recorded(peer: str, body: bytes) -> bytes:
            try:
                return await inner(peer, body)
            except SwarmError:
                raise
            except Exception as exc:
                log.append(f"{type(exc).__name__}: {exc} on {body[:80]!r}")
                raise

        server.handler = recorded

    # --- what a case does ----------------------------------------------------------------

    def target_node(self, name: str) -> Node:
        return self.validator if name == "submit" else self.trainer

    async def send(self, name: str, payload: bytes, sender: str = "mallory") -> bytes | None:
        """One request; ``None`` when the server refused or dropped it (a typed outcome)."""
        node = self.mallory if sender == "mallory" else self.honest
        try:
            return await node.request(self.target_node(name).peer_id, name, payload, FUZZ_LIMITS)
        except SwarmError:
            return None

    async def admin_line(self, line: bytes) -> dict[str, Any]:
        assert self.mallory.config.home is not None
        path = admin.socket_path(self.mallory.config.home.path)
        with trio.fail_after(10):
            stream = await trio.open_unix_socket(str(path))
            async with stream:
                await stream.send_all(line)
                await stream.send_eof()
                answer = await admin._read_line(stream, admin.MAX_ANSWER)
        return json.loads(answer)  # type: ignore[no-any-return]

    async def status_seconds(self, node: Node) -> float:
        """How long ``node``'s admin socket takes to answer a status request."""
        assert node.config.home is not None
        start = trio.current_time()
        answer = await admin.query(admin.socket_path(node.config.home.path), {"cmd": "status"})
        assert answer["status"]["peer_id"] == node.peer_id
        return trio.current_time() - start

    # --- the honest requests every handler must still answer -------------------------------

    async def honest_round(self) -> None:
        """Each protocol serves an honest request correctly (raises AssertionError else)."""
        raw = await self.send("policy", b"", "honest")
        assert raw is not None and decode(raw, PolicyAnnouncement).message.version >= 0
        raw = await self.send("manifest", ManifestRequest().to_bytes(), "honest")
        assert raw is not None and decode(raw, ShardManifest).message.version >= 0
        version = decode(raw, ShardManifest).message.version
        raw = await self.send("shard", ShardRequest("have", version).to_bytes(), "honest")
        assert raw is not None and Holdings.from_bytes(raw).complete
        raw = await self.send("ledger-sync", pack(["ranges", [["", 0, b""]]]), "honest")
        assert raw is not None and isinstance(msgpack.unpackb(raw), list)
        config = self._config_ref()
        raw = await self.send("run-files", file_request(config.sha256, 0), "honest")
        assert raw is not None and hashlib.sha256(raw).digest() == config.sha256
        # Unassigned work (prompt "p1"): the validator answers with its precheck's refusal
        # (issue 15: refused before any claim, storage or prefill), not with a verdict.
        honest_submission = sign(self._submission(self.honest.run_id), self.honest.key)
        validator = self.target_node("submit").peer_id
        try:
            await self.honest.request(validator, "submit", honest_submission.raw, FUZZ_LIMITS)
        except PeerError as exc:
            assert "refused (assignment)" in str(exc), f"the validator did not answer: {exc}"
        else:
            raise AssertionError("the validator judged unassigned work")
        status = await self.admin_line(b'{"cmd": "status"}\n')
        assert status["ok"] and status["status"]["role"] == "inference"

    def _config_ref(self) -> FileRef:
        return next(
            r for r in self.trainer.config.genesis.message.model.files if r.name == "config.json"
        )

    _counter = 0

    def _submission(self, run_id: str) -> RolloutSubmission:
        LiveSwarm._counter += 1
        sample = Sample("p1", (1, 2, 3), 7, (PROOF,), "stop")
        # A counter inside the run's quota (the precheck refuses the prompts, not the counter);
        # each submission distinct by its creation time.
        quota = self.trainer.config.genesis.message.params.quota or 1 << 30
        n = LiveSwarm._counter
        return RolloutSubmission(run_id, 0, n % quota, ("p1",), (sample,), 5 + n)

    # --- the targets ---------------------------------------------------------------------

    def targets(self) -> list[Target]:
        run_id = self.trainer.run_id
        mallory_submission = sign(self._submission(run_id), self.mallory.key).raw
        verdict = sign(
            Verdict(run_id, bytes(32), self.mallory.peer_id, True, "none", (), (1,), 5, {}),
            self.mallory.key,
        ).raw
        seeds: dict[str, tuple[bytes, ...]] = {
            "submit": (mallory_submission,),
            "samples": (pack([mallory_submission, verdict]),),
            "policy": (b"", b"\x00"),
            "ledger-sync": (pack(["ranges", [["", 0, b""]]]), pack(["get", [bytes(8)]])),
            "manifest": (ManifestRequest().to_bytes(), ManifestRequest(0).to_bytes()),
            "run-files": (
                file_request(self._config_ref().sha256, 0),
                file_request(bytes(32), 0),
                file_request(self._config_ref().sha256, 1 << 40),
            ),
            "shard": tuple(
                ShardRequest(op, 0, 0, 0, 100).to_bytes()  # type: ignore[arg-type]
                for op in ("have", "get", "channel")
            ),
        }
        extra: dict[str, tuple[st.SearchStrategy[bytes], ...]] = {
            "submit": (resigned("rollout-submission", (self.mallory.key,), run_id),),
            "samples": (
                st.tuples(
                    resigned("rollout-submission", (self.mallory.key,), run_id),
                    resigned("verdict", (self.mallory.key, self.validator.key), run_id),
                ).map(lambda pair: pack(list(pair))),
            ),
        }
        out = [
            Target(f"stream.{name}", self._stream_case(name), seeds[name], extra.get(name, ()))
            for name in HANDLERS
        ]
        admin_seeds = (b'{"cmd": "status"}\n', b'{"cmd": "announce", "version": 1}\n', b"[]\n")
        out.append(Target("admin.request_line", self._admin_case, admin_seeds))
        return out

    def _stream_case(self, name: str) -> Callable[[bytes], object]:
        log = self.untyped[name]

        def run(data: bytes) -> object:
            before = len(log)
            answer = self.call(self.send, name, data)
            if len(log) > before:
                raise AssertionError(f"stream.{name} handler raised {log[-1]}")
            if answer is None:
                raise PeerError("refused")  # a typed refusal
            return answer

        return run

    def _admin_case(self, data: bytes) -> object:
        answer = self.call(self.admin_line, data)
        if not isinstance(answer, dict) or "ok" not in answer:
            raise AssertionError(f"admin answered {answer!r}")
        if not answer["ok"] and str(answer.get("error", "")).startswith("internal error"):
            raise AssertionError(f"admin command failed untyped: {answer['error']}")
        if not answer["ok"]:
            raise PeerError(str(answer["error"]))
        return answer
