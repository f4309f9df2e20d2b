"""Two training children average through hivemind: each steps on its half of a batch, and both
end with the update one process makes on the whole batch (sample-weighted, float tolerance)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from node.compute.grpo import GRPOConfig, GRPOTrainer
from node.compute.train_child import ReplayChild, TrainerChild
from node.model import DEFAULT_MODEL_DIR, load_causal_lm, model_info
from node.roles.training_audit import UPDATE_TOLERANCE
from swarm.identity import NodeKey
from swarm.messages import GradientCommitment, decode, gradient_file
from tests.unit.test_fsdp import CONFIG, assert_one_update_apart, batch, gradients


def spec(root: Path, peer: str) -> dict[str, Any]:
    return {
        "model_dir": str(DEFAULT_MODEL_DIR),
        "config": CONFIG,
        "keep_versions": 3,
        "pad_id": model_info(DEFAULT_MODEL_DIR).pad_id,
        "checkpoint": str(root / peer / "trainer.ckpt"),
        "policies": str(root / peer / "policies"),
        "threads": 1,
        "group": {"peer": peer, "run_id": "test", "host": "127.0.0.1", "trainers": 2},
    }


@pytest.mark.slow
def test_two_children_averaging_make_the_update_of_one_process(tmp_path: Path) -> None:
    single = GRPOTrainer(
        load_causal_lm(DEFAULT_MODEL_DIR, dtype="float32"),
        GRPOConfig(**CONFIG),
        pad_id=model_info(DEFAULT_MODEL_DIR).pad_id,
    )
    single.step(batch())
    expected, grads = single.weights(), gradients(single)

    a = TrainerChild(spec(tmp_path, "A"))
    b = TrainerChild(spec(tmp_path, "B"))
    try:
        b.connect(a.hivemind_addrs)
        assert set(a.live()) == {"A", "B"} or set(b.live()) == {"A", "B"}
        groups = batch()
        halves = {"A": (a, groups[:3], None), "B": (b, groups[3:], None)}  # 12 and 8 samples
        out = run_round(halves, 0)
        assert out["A"]["round"]["members"] == ["A", "B"] == out["B"]["round"]["members"]
        assert out["A"]["round"]["group_samples"] == 20 and out["A"]["round"]["publisher"] == "A"
        for name in halves:
            assert_one_update_apart(load_file(out[name]["weights"]), expected, grads)
        # A round run again counts again (its undone try stays counted).
        assert a.status()["rounds_averaged"] >= 1 and b.status()["samples_contributed"] >= 8
    finally:
        a.close()
        b.close()


ROUND_TRIES = 3


def run_round(halves: dict[str, Any], parent: int) -> dict[str, dict[str, Any]]:
    """Each member steps from ``parent`` on its half at once (they meet in the averager). A
    round that fails (a member still computing its gradient when the other's 10 s search for
    a group ran out: a CI run beside the CPU-bound tests) is undone and run again, as the
    trainer does (``node/roles/trainer_group.py``): ``ROUND_TRIES`` in all."""

    def step(name: str, out: dict[str, dict[str, Any]]) -> None:
        child, mine, forged = halves[name]
        cited = [(bytes([i]) * 32, g.version) for i, g in enumerate(mine)]
        out[name] = child.step(mine, parent, 5, forged, cited=cited)

    for _ in range(ROUND_TRIES):
        out: dict[str, dict[str, Any]] = {}
        threads = [threading.Thread(target=step, args=(n, out)) for n in halves]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a member's step ran past 120 s"
        failed = {n: o["failed"] for n, o in out.items() if "failed" in o}
        if not failed and set(out) == set(halves):
            return out
        print(f"round from v{parent} failed, again: {failed}", flush=True)
        for name, o in out.items():
            if "failed" not in o:
                halves[name][0].discard(parent)  # its step of the void round, undone
    raise AssertionError(f"no round from v{parent} in {ROUND_TRIES} tries: {failed}")


def member_spec(root: Path, peer: str, key: NodeKey) -> dict[str, Any]:
    out = spec(root, peer)
    out["group"] = {**out["group"], "key": key.seed}
    out["states"] = str(root / peer / "states")
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_round_replays_from_the_members_commitments_and_a_forged_gradient_does_not(
    tmp_path: Path,
) -> None:
    """Two members average through hivemind for two rounds; in the second, B sends (and commits
    to) the negated gradient of its samples. The audit's replays, from the members' files:
    the averaging of the committed gradients gives the publisher's state after, within the
    tolerance, in both rounds; each member's gradient replays from its samples bit for bit,
    except B's forged one."""
    keys = {"A": NodeKey.generate(), "B": NodeKey.generate()}
    a = TrainerChild(member_spec(tmp_path, "A", keys["A"]))
    b = TrainerChild(member_spec(tmp_path, "B", keys["B"]))
    replay = ReplayChild()
    try:
        b.connect(a.hivemind_addrs)
        assert set(a.live()) == {"A", "B"} or set(b.live()) == {"A", "B"}
        for parent, groups, cheat in ((0, batch(), None), (1, batch(1, seed=9), "forge-gradient")):
            halves = {"A": (a, groups[:3], None), "B": (b, groups[3:], cheat)}

            out = run_round(halves, parent)
            rnd = out["A"]["round"]
            assert rnd["members"] == ["A", "B"] and rnd["publisher"] == "A"
            commitments = {n: decode(rnd["commitments"][n], GradientCommitment) for n in ("A", "B")}
            for name, c in commitments.items():
                assert c.signer == keys[name].peer_id and c.message.version == parent + 1
                assert c.message.samples == (12 if name == "A" else 8)
            files = {n: tmp_path / n / "states" for n in ("A", "B")}
            grad = {
                n: files[n] / gradient_file(parent + 1, c.message.gradient)
                for n, c in commitments.items()
            }
            common = {
                "model_dir": str(DEFAULT_MODEL_DIR),
                "config": CONFIG,
                "serve_dtype": "float32",
                "pad_id": model_info(DEFAULT_MODEL_DIR).pad_id,
                "parent": parent,
                "seed": 5,
                "threads": 1,
                "old": {"0": str(tmp_path / "A" / "policies" / "v0.safetensors")} if parent else {},
            }
            averaged = replay.average(
                {
                    **common,
                    "state": str(files["A"] / f"s{parent}.safetensors"),
                    "members": [
                        {"path": str(grad[n]), "samples": s} for n, s in (("A", 12), ("B", 8))
                    ],
                    "after": str(files["A"] / f"s{parent + 1}.safetensors"),
                    "published": out["A"]["weights"],
                }
            )
            assert averaged["gradients"] == [commitments[n].message.gradient for n in "AB"]
            assert averaged["before"] == out["A"]["state"]["before"]
            assert averaged["their_after"] == out["A"]["state"]["after"]
            assert averaged["update_error"] <= UPDATE_TOLERANCE, averaged
            if not parent:
                # A member that sent one gradient and committed to another: what it serves is
                # either not its commitment, or (served as committed) not what the publisher
                # stepped on, so the averaging replayed from it misses the state after.
                other = tmp_path / "other-g1.safetensors"
                theirs = load_file(str(grad["B"]))
                save_file({k: -v for k, v in theirs.items()}, str(other))
                members = [
                    {"path": str(grad["A"]), "samples": 12},
                    {"path": str(other), "samples": 8},
                ]
                off = replay.average(
                    {
                        **common,
                        "state": str(files["A"] / "s0.safetensors"),
                        "members": members,
                        "after": str(files["A"] / "s1.safetensors"),
                        "published": out["A"]["weights"],
                    }
                )
                assert off["gradients"][1] != commitments["B"].message.gradient
                assert off["update_error"] > UPDATE_TOLERANCE, off
            for name, (_, mine, forged) in halves.items():
                got = replay.gradient(
                    {
                        **common,
                        "groups": [g.to_wire() for g in mine],
                        "state": str(files[name] / f"s{parent}.safetensors"),
                        "theirs": str(grad[name]),
                    }
                )
                assert got["before"] == commitments[name].message.state_before
                if forged:
                    assert got["gradient"] != commitments[name].message.gradient
                    assert got["error"] > 1.0  # the negated gradient: 2 of its norm away
                else:
                    assert got["gradient"] == commitments[name].message.gradient
                    assert got["error"] == 0.0
    finally:
        replay.close()
        a.close()
        b.close()
