"""Issue 25, what inference runs: the training child writes each version in the genesis's
``serve_dtype`` while its masters, held versions and checkpoint stay float32; a genesis from
before the parameter serves float32; a trainer that loads a published bf16 copy keeps the float32
masters that round to it; ``logp_old`` of an older version uses that version as served; the
in-process loop generates from each version as served."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import node.roles.trainer as trainer_role
from node.compute.groups import Group
from node.compute.grpo import GRPOConfig, GRPOTrainer, served_weights
from node.compute.torch_engine import TorchEngine
from node.compute.train_child import _Training, keep_masters
from node.model import DEFAULT_MODEL_DIR, model_info
from node.rl.inprocess import _ServedPolicy
from node.run import create_genesis
from swarm.identity import NodeKey
from swarm.messages import RunGenesis, RunParams, decode
from swarm.wire import canonical, seal
from tests.unit.test_grpo import TARGET, tiny_model

OWNER = NodeKey.from_seed(b"\x35" * 32)


def child_args(root: Path, serve_dtype: str | None) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model_dir": str(DEFAULT_MODEL_DIR),
        "config": {"learning_rate": 1e-3, "max_tokens": 8, "max_grad_norm": 1.0},
        "keep_versions": 3,
        "pad_id": model_info(DEFAULT_MODEL_DIR).pad_id,
        "checkpoint": str(root / "trainer.ckpt"),
        "policies": str(root / "policies"),
        "threads": 1,
        "group": None,
    }
    if serve_dtype is not None:
        args["serve_dtype"] = serve_dtype
    return args


def one_step(training: _Training) -> str:
    groups = [Group([60, 61, 43], [[70, 71, 72], [73, 74]], [1.0, 0.0], 0)]
    out = training.serve("step", {"groups": [g.to_wire() for g in groups], "version": 0})
    return str(out["weights"])


def file_dtypes(path: str) -> set[str]:
    with safe_open(path, "pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (no __iter__)


def float_dtypes(state: dict[str, torch.Tensor]) -> set[torch.dtype]:
    return {v.dtype for v in state.values() if v.is_floating_point()}


def test_a_bfloat16_run_writes_versions_in_bfloat16_and_trains_float32_masters(
    tmp_path: Path,
) -> None:
    training = _Training(child_args(tmp_path, "bfloat16"))
    path = one_step(training)
    assert path.endswith("v1.safetensors") and file_dtypes(path) == {"BF16"}
    masters = training.grpo.weights()
    assert float_dtypes(masters) == {torch.float32}
    assert {p.dtype for p in training.grpo.model.parameters()} == {torch.float32}
    assert all(float_dtypes(s) == {torch.float32} for s in training.grpo._snapshots.values())
    checkpoint = torch.load(tmp_path / "trainer.ckpt", weights_only=True)
    assert float_dtypes(checkpoint["model"]) == {torch.float32}
    # The file is the masters rounded to bf16, and the step moved some weights by less than
    # a bf16 step: the masters are not bf16 values themselves.
    written = load_file(path)
    assert all(torch.equal(written[k], v.to(torch.bfloat16)) for k, v in masters.items())
    assert any(not torch.equal(v.to(torch.bfloat16).float(), v) for v in masters.values())


def test_a_float32_run_writes_versions_in_float32(tmp_path: Path) -> None:
    training = _Training(child_args(tmp_path, "float32"))
    path = one_step(training)
    assert file_dtypes(path) == {"F32"}
    written = load_file(path)
    assert all(torch.equal(written[k], v) for k, v in training.grpo.weights().items())


def legacy_params() -> RunParams:
    """The parameters of a genesis signed before issue 25 (no ``serve_dtype`` key)."""
    genesis = create_genesis(
        OWNER, name="old", trainers=[OWNER.peer_id], validators=[OWNER.peer_id]
    ).message
    wire = genesis.to_wire()
    wire["params"] = {k: v for k, v in wire["params"].items() if k != "serve_dtype"}
    payload = canonical(wire)
    raw = seal(RunGenesis.KIND, payload, OWNER.public, OWNER.signature(RunGenesis.KIND, payload))
    return decode(raw, RunGenesis).message.params


def test_a_genesis_from_before_serve_dtype_writes_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = legacy_params()
    assert params.serve_dtype == "float32" and RunParams().serve_dtype == "bfloat16"
    specs: list[dict[str, Any]] = []
    monkeypatch.setattr(trainer_role, "TrainerChild", lambda spec, log_path: specs.append(spec))
    role = SimpleNamespace(
        model_dir=DEFAULT_MODEL_DIR,
        params=params,
        in_group=False,
        device="cpu",
        run_dir=tmp_path,
        log=SimpleNamespace(states=tmp_path / "states"),
        threads=1,
        chat_template=False,
        nproc=1,
    )
    trainer_role.Trainer._start_child(role)  # type: ignore[arg-type]
    assert specs[0]["serve_dtype"] == "float32"
    training = _Training(specs[0] | {"config": child_args(tmp_path, None)["config"]})
    assert file_dtypes(one_step(training)) == {"F32"}


def test_a_child_spec_without_serve_dtype_writes_float32(tmp_path: Path) -> None:
    assert file_dtypes(one_step(_Training(child_args(tmp_path, None)))) == {"F32"}


def test_loading_a_bfloat16_copy_keeps_the_masters_that_round_to_it() -> None:
    masters = {"w": torch.tensor([1.0001, 2.0, -3.0007]), "n": torch.tensor([3])}
    copy = served_weights(masters, "bfloat16")
    copy["w"][2] = -2.5  # another trainer's step moved this weight
    got = keep_masters(copy, masters)
    assert got["w"].dtype == torch.float32
    assert got["w"].tolist() == [masters["w"][0].item(), 2.0, -2.5]
    assert torch.equal(got["w"].to(torch.bfloat16), copy["w"])  # serves exactly the copy
    assert torch.equal(got["n"], masters["n"])
    f32 = {"w": torch.tensor([1.5, 2.0, 3.0])}
    assert torch.equal(keep_masters(f32, masters)["w"], f32["w"])  # float32: the copy as is


def test_the_child_loading_its_own_published_bfloat16_copy_keeps_its_masters(
    tmp_path: Path,
) -> None:
    training = _Training(child_args(tmp_path, "bfloat16"))
    path = one_step(training)
    before = {k: v.clone() for k, v in training.grpo.weights().items()}
    training.serve("load", {"version": 1, "path": path})
    after = training.grpo.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert float_dtypes(after) == {torch.float32}


def test_logp_old_of_an_older_version_uses_its_weights_as_served() -> None:
    cfg = GRPOConfig(learning_rate=1e-2, max_tokens=1)
    trainer = GRPOTrainer(tiny_model(), cfg, serve_dtype="bfloat16")
    v0 = {k: v.clone() for k, v in trainer.weights().items()}
    trainer.step([Group([1], [[TARGET], [7]], [1.0, 0.0], 0)])
    ids, attention = torch.tensor([[1, TARGET], [1, 7]]), torch.ones(2, 2, dtype=torch.long)
    got = trainer._old_logprobs(0, ids, attention)

    def logp(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        model = tiny_model()
        model.load_state_dict(weights)
        with torch.no_grad():
            out: torch.Tensor = trainer._logprobs(model, ids, attention)[0]
        return out

    assert torch.equal(got, logp(served_weights(v0, "bfloat16")))
    assert not torch.equal(got, logp(v0))  # the tiny random model's masters are not bf16
    assert float_dtypes(trainer._snapshots[0]) == {torch.float32}
    assert all(torch.equal(trainer._snapshots[0][k], v) for k, v in v0.items())


def test_the_inprocess_loop_generates_from_each_version_as_served(tmp_path: Path) -> None:
    engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR, dtype="float32")
    trainer = GRPOTrainer(engine.model, GRPOConfig(learning_rate=1e-2, max_tokens=2))
    trainer.step([Group([1, 60], [[70, 71], [72]], [1.0, 0.0], 0)])
    masters = trainer.weights()
    bf16 = _ServedPolicy(engine, trainer, "bfloat16", tmp_path)
    assert bf16.engine is not engine
    served = bf16.engine.model.state_dict()  # a float32 CPU engine, as a worker's
    assert float_dtypes(served) == {torch.float32}
    assert all(torch.equal(served[k], v.to(torch.bfloat16).float()) for k, v in masters.items())
    assert _ServedPolicy(engine, trainer, "float32", tmp_path).engine is engine


def test_a_tied_embedding_is_written_once_and_filled_back_on_load() -> None:
    """Qwen2-style models tie lm_head to the embedding: a version stores the tensor once (as
    Hugging Face does), and the loader fills the copy back in."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from node.compute.train_child import tied_copies
    from node.model.loading import load_weights_into

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    assert tied_copies(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    stored = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    other = Qwen2ForCausalLM(config)
    import tempfile

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/v.safetensors"
        save_file({k: v.contiguous() for k, v in stored.items()}, path)
        load_weights_into(other, path)
    assert torch.equal(other.lm_head.weight, model.model.embed_tokens.weight)
