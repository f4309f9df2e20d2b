"""Yamux window updates as go-yamux sends them: once half the receive window has been read.

py-libp2p 0.8's ``YamuxStream`` sends a WINDOW_UPDATE frame after every read that consumed
data (its "partial slack" path, and its ``RELEASE_ON_READ`` path; the environment switch
``PY_YAMUX_RELEASE_ON_READ=0`` turns off only the second). Our peers read length prefixes and
multistream lines a byte at a time, so one DHT request on a connected peer cost 14 window
updates (5,712 for 400 requests, ``bench/yamux_window.py``), each a Noise-encrypted frame to
write and for the peer to read. go-yamux (``sendWindowUpdate``) sends one only when the
window is short by half or more, then grows it back whole; py-libp2p keeps that rule
(``GrowTo`` with hysteresis, and its auto-tuning) as its first path, and it is the one kept
here. Flow control is unchanged: a writer that used the whole window waits for a reader that
has read at least half of it, and that read sends the update.

Measured on one 2-core machine, both hosts in one process (``bench/yamux_window.py``): a DHT
request 29% less CPU (6.46 to 4.63 ms), a bulk stream 92-103 to 129-135 MiB/s.

A class attribute patched once per process: py-libp2p builds its streams inside ``Yamux``,
with no hook to pass our own class. ``swarm/internals.py`` checks the name at start.
"""

from __future__ import annotations

from typing import Any

from libp2p.stream_muxer.yamux.yamux import YamuxStream

_NAME = "_auto_tune_and_send_window_update"


def install_go_yamux_window_updates() -> bool:
    """Make every yamux stream of this process send window updates by go-yamux's rule.

    Idempotent. False when this py-libp2p has no such method (the default stays; the node
    warns about it through ``swarm.internals``)."""
    current = getattr(YamuxStream, _NAME, None)
    if current is None:
        return False
    if getattr(current, "_go_yamux_rule", False):
        return True
    original = current

    async def past_half_a_window(self: Any, *, bytes_read: int = 0) -> None:
        # bytes_read=0: only py-libp2p's first path is left, the update once the window is
        # short by half or more (``_grow_threshold``), grown back whole and auto-tuned.
        del bytes_read
        await original(self, bytes_read=0)

    past_half_a_window._go_yamux_rule = True  # type: ignore[attr-defined]
    setattr(YamuxStream, _NAME, past_half_a_window)
    return True
