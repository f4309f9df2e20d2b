"""Self-healing of a node's compute child (issue 15; every role since issue 28: the
validator's and the worker's engine child, the trainer's training child): restart a dead child
with backoff, up to a limit, then give up loudly.

Decisions owned here (``EngineHealer``):
- What counts: an ``EngineError`` from a call; the caller hands it to ``recover``, which
  restarts the engine (``restart()``, off the event loop: a fresh child loads the model and the
  weights it held) and answers True, or False once it gave up. The call that failed is not
  retried here: the work it carried is answered with an error and may be sent again.
- Backoff: the n-th restart within ``window_s`` waits ``first_backoff_s * 2**(n-1)`` (capped
  at ``max_backoff_s``) before it starts, so a child that dies at once does not spin the CPU.
- Limit: more than ``max_restarts`` restarts within ``window_s`` (or a restart that fails) and
  the healer gives up: ``failed`` says why (shown in ``status``), the log says it at ERROR with
  what to do, and ``on_give_up`` runs (the role stops advertising itself).
- Cancellation: a cancelled ``recover`` leaves the engine as it was (dead or restarted); the
  next failure calls it again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from swarm.errors import EngineError

log = logging.getLogger(__name__)


class EngineHealer:
    def __init__(
        self,
        engine: Any,
        *,
        max_restarts: int = 3,
        window_s: float = 600.0,
        first_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        on_give_up: Callable[[str], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        what: str = "engine child",
    ) -> None:
        self.engine = engine
        self.what = what
        """What is restarted, as the log names it."""
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.on_give_up = on_give_up
        self.clock = clock
        self.restarts = 0
        """Restarts since the node started (the metric ``engine_restarts``)."""
        self.failed: str | None = None
        """Why the healer gave up (None while it has not)."""
        self._recent: deque[float] = deque()

    async def recover(self, cause: EngineError) -> bool:
        """Restart the engine after ``cause``; False once the healer gave up."""
        if self.failed is not None:
            return False
        restart = getattr(self.engine, "restart", None)
        now = self.clock()
        while self._recent and now - self._recent[0] > self.window_s:
            self._recent.popleft()
        if restart is None:
            return await self._give_up(f"the {self.what} cannot be restarted ({cause})")
        if len(self._recent) >= self.max_restarts:
            return await self._give_up(
                f"the {self.what} died {len(self._recent) + 1} times within"
                f" {self.window_s:.0f} s (last: {_first_line(cause)})"
            )
        delay = min(self.first_backoff_s * 2 ** len(self._recent), self.max_backoff_s)
        self._recent.append(now)
        self.restarts += 1
        log.warning(
            "%s died (%s); restart %d of %d in %.0f s",
            self.what,
            _first_line(cause),
            len(self._recent),
            self.max_restarts,
            delay,
        )
        await trio.sleep(delay)
        try:
            await trio.to_thread.run_sync(restart)
        except EngineError as exc:
            return await self._give_up(f"restarting the {self.what} failed: {_first_line(exc)}")
        log.info("%s restarted", self.what)
        return True

    async def _give_up(self, why: str) -> bool:
        self.failed = why
        log.error(
            "%s; giving up: this node no longer serves its role. Check the child log above"
            " (memory, GPU, model files), then restart the node.",
            why,
        )
        if self.on_give_up is not None:
            await self.on_give_up(why)
        return False

    def status(self) -> dict[str, Any]:
        return {"restarts": self.restarts, "failed": self.failed}


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
