"""Every message type: decode(encode(m)) == m, and no byte string raises anything but SwarmError."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarm.errors import MalformedError, SwarmError
from swarm.identity import NodeKey
from swarm.messages import (
    MESSAGE_TYPES,
    Evaluation,
    Fields,
    FileRef,
    LedgerEvent,
    ModelSpec,
    PolicyAnnouncement,
    RoleAdvert,
    RolloutSubmission,
    RunGenesis,
    RunParams,
    Sample,
    SampleReceipt,
    ShardFile,
    ShardManifest,
    TrainingDispute,
    TrainingRecord,
    Verdict,
    decode,
    decode_any,
    sign,
)
from swarm.messages.training import DISPUTE_REASONS, GradientCommitment

KEY = NodeKey.from_seed(b"\x07" * 32)
PEERS = [NodeKey.from_seed(bytes([i]) * 32).peer_id for i in range(1, 6)]

u64 = st.integers(min_value=0, max_value=2**63 - 1)
text = st.text(max_size=40)
digest = st.binary(min_size=32, max_size=32)
peer = st.sampled_from(PEERS)
scalar = st.one_of(st.integers(-(2**40), 2**40), text, st.booleans())
plain_map = st.dictionaries(st.text(max_size=10), scalar, max_size=4)

file_ref = st.builds(
    FileRef,
    name=st.sampled_from(["config.json", "tokenizer.json", "generation_config.json", "a.jsonl"]),
    sha256=digest,
    size=u64,
)
genesis = st.builds(
    RunGenesis,
    name=text,
    created_at=u64,
    model=st.builds(
        ModelSpec,
        name=text,
        config=plain_map,
        manifest_id=st.binary(max_size=32),
        files=st.lists(file_ref, max_size=3, unique_by=lambda r: r.name).map(tuple),
        weights=st.one_of(st.none(), file_ref.map(lambda r: FileRef("w.safetensors", r.sha256, 1))),
        chat_template=st.booleans(),
    ),
    task_suite=text,
    task_data=st.one_of(st.none(), file_ref),
    task_files=st.lists(file_ref, max_size=3, unique_by=lambda r: r.name).map(tuple),
    task_spec=text,
    task_seed=st.integers(-(2**31), 2**31),
    trainers=st.lists(peer, min_size=1, max_size=3).map(tuple),
    validators=st.lists(peer, min_size=1, max_size=3).map(tuple),
    params=st.builds(
        RunParams,
        async_level=st.integers(0, 8),
        group_size=st.integers(2, 64),
        temperature=st.floats(0, 4, allow_nan=False),
        learning_rate=st.floats(1e-8, 1, allow_nan=False),
    ),
)
advert = st.builds(
    RoleAdvert,
    run_id=text,
    peer_id=peer,
    role=st.sampled_from(["trainer", "inference", "validator", "bootstrap"]),
    software=text,
    addrs=st.lists(text, max_size=3).map(tuple),
    issued_at=u64,
    expires_at=u64,
    capabilities=plain_map,
)
announcement = st.builds(
    PolicyAnnouncement, run_id=text, version=u64, manifest_id=digest, issued_at=u64
)


@st.composite
def manifests(draw: st.DrawFn) -> ShardManifest:
    shard_size = draw(st.integers(1, 1000))
    sizes = draw(st.lists(st.integers(0, 3000), min_size=1, max_size=3))
    files, offset = [], 0
    for i, size in enumerate(sizes):
        files.append(ShardFile(path=f"part{i}.safetensors", offset=offset, size=size))
        offset += size
    count = -(-offset // shard_size)
    hashes = draw(st.lists(digest, min_size=count, max_size=count))
    return ShardManifest(
        run_id=draw(text),
        version=draw(u64),
        files=tuple(files),
        shard_size=shard_size,
        shard_hashes=tuple(hashes),
        total_size=offset,
        created_at=draw(u64),
    )


sample = st.builds(
    Sample,
    prompt_id=text,
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40).map(tuple),
    seed=u64,
    proofs=st.lists(st.binary(min_size=258, max_size=258), max_size=2).map(tuple),
    finish_reason=st.sampled_from(["stop", "length"]),
)
submission = st.builds(
    RolloutSubmission,
    run_id=text,
    policy_version=u64,
    counter=u64,
    prompt_ids=st.lists(text, max_size=4).map(tuple),
    samples=st.lists(sample, max_size=4).map(tuple),
    created_at=u64,
)
verdict = st.builds(
    Verdict,
    run_id=text,
    submission_id=digest,
    worker=peer,
    accepted=st.booleans(),
    severity=st.sampled_from(["none", "soft", "hard"]),
    reasons=st.lists(text, max_size=3).map(tuple),
    rewards=st.lists(st.integers(-(10**9), 10**9), max_size=8).map(tuple),
    created_at=u64,
    metrics=st.dictionaries(
        st.text(max_size=10), st.one_of(st.integers(-(2**63), 2**63 - 1), text), max_size=4
    ),
)
event = st.builds(
    LedgerEvent,
    run_id=text,
    event=st.sampled_from(["grant", "credit", "slash"]),
    peer=peer,
    amount=u64,
    evidence=st.binary(max_size=32),
    created_at=u64,
)


@st.composite
def evaluations(draw: st.DrawFn) -> Evaluation:
    ids = draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=8, unique=True))
    scores = draw(st.lists(st.integers(0, 10**6), min_size=len(ids), max_size=len(ids)))
    return Evaluation(
        run_id=draw(text),
        version=draw(u64),
        seed=draw(u64),
        item_ids=tuple(ids),
        scores=tuple(scores),
        mean=round(sum(scores) / len(scores)),
        created_at=draw(u64),
    )


id32 = st.binary(min_size=32, max_size=32)


@st.composite
def training_records(draw: st.DrawFn) -> TrainingRecord:
    parent = draw(st.integers(0, 2**40))
    verdicts = draw(st.lists(id32, max_size=6, unique=True))
    return TrainingRecord(
        run_id=draw(text),
        version=parent + 1,
        parent=parent,
        min_version=draw(st.integers(0, parent)),
        verdicts=tuple(verdicts),
        sample_versions=tuple(draw(st.integers(0, parent)) for _ in verdicts),
        config=draw(text),
        seed=draw(u64),
        state_before=draw(st.binary(max_size=32)),
        state_after=draw(st.binary(max_size=32)),
        weights=draw(st.binary(max_size=32)),
        created_at=draw(u64),
        members=tuple(draw(st.lists(st.binary(max_size=64), max_size=2))),
    )


@st.composite
def gradient_commitments(draw: st.DrawFn) -> GradientCommitment:
    verdicts = draw(st.lists(id32, max_size=4))
    return GradientCommitment(
        run_id=draw(text),
        version=draw(st.integers(1, 2**40)),
        samples=draw(u64),
        verdicts=tuple(verdicts),
        sample_versions=tuple(draw(u64) for _ in verdicts),
        seed=draw(u64),
        threads=draw(st.integers(0, 512)),
        state_before=draw(st.binary(max_size=32)),
        gradient=draw(st.binary(max_size=32)),
        created_at=draw(u64),
    )


receipts = st.builds(
    SampleReceipt,
    run_id=text,
    submission_id=id32,
    verdict_id=id32,
    worker=text,
    sample_version=u64,
    trainer_version=u64,
    queued=st.booleans(),
    seq=u64,
    created_at=u64,
)
training_disputes = st.builds(
    TrainingDispute,
    run_id=text,
    version=u64,
    trainer=text,
    record=st.binary(max_size=32),
    reason=st.sampled_from(DISPUTE_REASONS),
    detail=st.text(max_size=64),
    created_at=u64,
    related=st.lists(id32, max_size=3).map(tuple),
)

any_message = st.one_of(
    genesis,
    advert,
    announcement,
    manifests(),
    submission,
    verdict,
    event,
    evaluations(),
    training_records(),
    receipts,
    training_disputes,
    gradient_commitments(),
)


def test_every_message_type_has_a_strategy() -> None:
    assert len(MESSAGE_TYPES) == 12


@given(message=any_message)
def test_decode_of_encode_is_identity(message: Any) -> None:
    signed = sign(message, KEY)
    assert decode(signed.raw, type(message)).message == message
    assert decode_any(signed.raw).message == message


@given(data=st.binary(max_size=600))
def test_random_bytes_raise_only_swarm_errors(data: bytes) -> None:
    with pytest.raises(SwarmError):
        decode_any(data)


@given(message=any_message, data=st.data())
def test_mutated_envelopes_raise_only_swarm_errors(message: Any, data: st.DataObject) -> None:
    raw = bytearray(sign(message, KEY).raw)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[at] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[at : at + data.draw(st.integers(1, 8))]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        back = decode_any(bytes(raw))
    except SwarmError:
        return
    # A mutation that still verifies must decode to exactly the original (e.g. a no-op cut).
    assert back.message == message


def test_genesis_requires_ed25519_peer_ids() -> None:
    with pytest.raises(MalformedError):
        RunGenesis(
            name="x",
            created_at=0,
            model=ModelSpec("m"),
            task_suite="s",
            task_seed=0,
            trainers=("nope",),
            validators=(PEERS[0],),
        )


def test_run_params_keep_unknown_keys_and_parse_decimal_strings() -> None:
    params = RunParams.from_map({"temperature": "0.5", "future_knob": 3, "async_level": 1})
    assert params.temperature == 0.5 and params.async_level == 1
    assert params.to_wire()["future_knob"] == 3
    assert RunParams.from_map(params.to_wire()) == params
    with pytest.raises(MalformedError):
        RunParams.from_map({"async_level": "2"})  # signed ints are ints, not text


def test_manifest_layout_must_add_up() -> None:
    with pytest.raises(MalformedError):
        ShardManifest(
            run_id="r",
            version=1,
            files=(ShardFile("a", 0, 10),),
            shard_size=4,
            shard_hashes=(b"\x00" * 32,),
            total_size=10,
            created_at=0,
        )
    with pytest.raises(MalformedError, match="relative"):
        ShardFile.from_wire(Fields("shard-file", {"path": "../etc/passwd", "offset": 0, "size": 1}))
