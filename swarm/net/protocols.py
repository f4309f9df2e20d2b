"""Size limits and deadlines of the request/response protocols that several roles share.

The names live in ``swarm.net.names``; the limits live here, next to the message sizes they
follow, so the side that serves a protocol and the side that asks it cannot disagree.
"""

from __future__ import annotations

from typing import Final

from swarm.messages import RolloutSubmission, Verdict
from swarm.net.streams import StreamLimits

SUBMIT_LIMITS: Final = StreamLimits(
    max_request=RolloutSubmission.MAX_BYTES + 1024,
    max_response=Verdict.MAX_BYTES + 1024,
    timeout=120.0,
    concurrency=8,
    per_peer=2,
    reserved=4,  # for workers with accepted work (the validator's ``trusted``): 12 x 8 MiB at most
)
SAMPLES_LIMITS: Final = StreamLimits(
    max_request=RolloutSubmission.MAX_BYTES + Verdict.MAX_BYTES + 4096,
    max_response=4096,  # the trainer's signed SampleReceipt
    timeout=30.0,
)
EVIDENCE_LIMITS: Final = StreamLimits(
    max_request=64,
    max_response=max(RolloutSubmission.MAX_BYTES, Verdict.MAX_BYTES) + 1024,
    timeout=30.0,
    concurrency=8,
)
"""One envelope per request: the 32-byte id asked for, the envelope's bytes answered."""
