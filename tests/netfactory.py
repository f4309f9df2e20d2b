"""Start many real nodes on 127.0.0.1 in one trio run, and wait for conditions with deadlines.

    async with NetFactory(trainers=1, validators=1) as net:
        boot = await net.bootstrap()
        a = await net.node("trainer")              # key net.trainer_keys[0], joins via boot
        await wait_until(lambda: a.peers_by_role()["inference"], 10)

Every node stops when the factory's block ends, in reverse order of start.
"""

from __future__ import annotations

import hashlib
import inspect
import linecache
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.home import NodeHome
from node.run import create_genesis
from node.runtime import Node, RuntimeConfig
from swarm.identity import NodeKey
from swarm.messages import RunGenesis, Signed
from swarm.net import DialPolicy

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
FAST_DIAL = DialPolicy(attempts=3, timeout=3.0, backoff=0.1, max_backoff=0.5)


def key_named(name: str) -> NodeKey:
    return NodeKey.from_seed(hashlib.sha256(name.encode()).digest())


def loopback_config(
    key: NodeKey, genesis: Signed[RunGenesis], role: Any, bootstrap: list[str], **extra: Any
) -> RuntimeConfig:
    """A node of ``role`` listening on 127.0.0.1 (a free port) that joins through
    ``bootstrap`` and dials with test-speed retries; ``extra``: any other ``RuntimeConfig``
    field."""
    return RuntimeConfig(
        key=key,
        genesis=genesis,
        role=role,
        listen=LOOPBACK,
        bootstrap=bootstrap,
        dial=FAST_DIAL,
        **extra,
    )


async def wait_until(
    condition: Callable[[], Any | Awaitable[Any]], timeout: float, poll: float = 0.05
) -> Any:
    """Poll ``condition`` until it is truthy (returned) or ``timeout`` seconds pass (fails with
    ``WaitTimedOut``, naming the caller's line: a CI log then says which wait it was)."""
    try:
        with trio.fail_after(timeout):
            while True:
                value = condition()
                if inspect.isawaitable(value):
                    value = await value
                if value:
                    return value
                await trio.sleep(poll)
    except trio.TooSlowError:
        raise WaitTimedOut(f"timed out after {timeout:g} s at {_callers()}") from None


def _callers(depth: int = 3) -> str:
    """Where a wait was asked for: the caller's line and call, and, while that caller is a
    helper (not a test), the line that called the helper: ``screen_until`` at line 98 says
    nothing, the test's line that called it does."""
    places = []
    for frame in inspect.stack(context=0)[2 : 2 + depth]:
        first = frame.positions.lineno or frame.lineno
        last = frame.positions.end_lineno or first
        call = " ".join(
            linecache.getline(frame.filename, n).strip() for n in range(first, last + 1)
        )
        places.append(f"{Path(frame.filename).name}:{first}: {call[:300]}")
        if frame.function.startswith("test_") or "site-packages" in frame.filename:
            break
    return ", called at ".join(places)


class WaitTimedOut(trio.TooSlowError):
    """A ``wait_until`` deadline passed (a ``trio.TooSlowError``, so callers that expect one
    still catch it)."""


class NetFactory:
    def __init__(
        self,
        trainers: int = 1,
        validators: int = 1,
        *,
        heartbeat: float = 0.2,
        discover_every_s: float = 1.0,
        home_root: Path | None = None,
    ) -> None:
        self.owner = key_named("owner")
        self.trainer_keys = [key_named(f"trainer-{i}") for i in range(trainers)]
        self.validator_keys = [key_named(f"validator-{i}") for i in range(validators)]
        self.genesis = create_genesis(
            self.owner,
            name="test-run",
            trainers=[k.peer_id for k in self.trainer_keys],
            validators=[k.peer_id for k in self.validator_keys],
            created_at=1,
        )
        self.heartbeat = heartbeat
        self.discover_every_s = discover_every_s
        self.home_root = home_root
        self.nodes: list[Node] = []
        self.boot: BootstrapPeer | None = None
        self._stack = AsyncExitStack()
        self._count = 0

    async def __aenter__(self) -> NetFactory:
        await self._stack.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stack.__aexit__(*exc)

    async def bootstrap(self, key: NodeKey | None = None) -> BootstrapPeer:
        self.boot = await self._stack.enter_async_context(
            BootstrapPeer.start(
                BootstrapConfig(
                    key=key or key_named("bootstrap"),
                    listen=LOOPBACK,
                    heartbeat=self.heartbeat,
                    genesis=(self.genesis,),
                )
            )
        )
        return self.boot

    def config(
        self,
        role: str,
        key: NodeKey | None = None,
        *,
        bootstrap: list[str] | None = None,
        home: bool = False,
        **extra: Any,
    ) -> RuntimeConfig:
        self._count += 1
        if key is None:
            if role == "trainer":
                key = self.trainer_keys[0]
            elif role == "validator":
                key = self.validator_keys[0]
            else:
                key = key_named(f"inference-{self._count}")
        if bootstrap is None:
            bootstrap = self.boot.addrs()[:1] if self.boot else []
        node_home = None
        if home:
            assert self.home_root is not None
            node_home = NodeHome(self.home_root / f"n{self._count}")
        return loopback_config(
            key,
            self.genesis,
            role,
            bootstrap,
            home=node_home,
            heartbeat=self.heartbeat,
            discover_every_s=self.discover_every_s,
            **extra,
        )

    async def node(self, role: str, key: NodeKey | None = None, **kw: Any) -> Node:
        node = await self._stack.enter_async_context(Node.start(self.config(role, key, **kw)))
        self.nodes.append(node)
        return node

    @asynccontextmanager
    async def node_scope(
        self, role: str, key: NodeKey | None = None, **kw: Any
    ) -> AsyncIterator[Node]:
        """A node that leaves when this block ends (before the factory's other nodes)."""
        async with Node.start(self.config(role, key, **kw)) as node:
            yield node

    async def start_config(self, config: RuntimeConfig) -> Node:
        node = await self._stack.enter_async_context(Node.start(config))
        self.nodes.append(node)
        return node
