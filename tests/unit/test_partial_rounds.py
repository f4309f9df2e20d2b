"""hivemind finishes an all-reduce that lost a peer mid-way; ``partial_of`` tells such a round
from a whole one, read from hivemind's own part structures (real ones, in a process of their
own: hivemind and py-libp2p cannot share one)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import asyncio, torch
from types import SimpleNamespace
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from node.compute.averaging import partial_of

async def main():
    tensors = [torch.ones(64), torch.ones(32)]
    def runner():
        container = TensorPartContainer(tensors, (0.5, 0.5), part_size_bytes=64)
        reducer = TensorPartReducer([torch.Size([16])] * 3, num_senders=2)
        return SimpleNamespace(tensor_part_container=container, tensor_part_reducer=reducer)
    whole = runner()
    print("whole", partial_of(whole))
    peer_died = runner()  # the peer that reduced half our parts died before answering
    peer_died.tensor_part_container.register_failed_reducer(1)
    print("reducer", partial_of(peer_died))
    sender_left = runner()  # a sender left before sending its parts to us
    sender_left.tensor_part_reducer.on_sender_failed(1)
    print("sender", partial_of(sender_left))
    done = runner()  # a sender that had sent everything, then left: nothing is missing
    done.tensor_part_reducer.num_parts_received[1] = 3
    done.tensor_part_reducer.on_sender_failed(1)
    print("done", partial_of(done))

asyncio.run(main())
"""


def test_a_round_that_lost_a_peer_mid_way_is_partial_and_a_whole_one_is_not() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    said = dict(line.split(" ", 1) for line in out)
    assert said["whole"] == "None"
    assert said["done"] == "None"
    assert said["reducer"] == "48 values came back unreduced"
    assert said["sender"] == "1 sender(s) left the parts we reduced"
