"""Engine, device and dtype from the command line: defaults with reasons, bad input refused."""

from __future__ import annotations

import re

import pytest

from node.compute.devices import Accelerators, EngineChoice, check_nproc, choose
from swarm.errors import ConfigError

NONE = Accelerators((), vllm=False, note="no NVIDIA device on this machine")
TWO_GPUS = Accelerators(("NVIDIA H200", "NVIDIA H200"), vllm=True, note="torch 2.11")


def test_defaults_follow_the_machine_and_say_why() -> None:
    cpu = choose(acc=NONE)
    assert cpu == EngineChoice("torch", "cpu", "float32")
    assert any("no NVIDIA device" in r for r in cpu.reasons)
    gpu = choose(acc=TWO_GPUS)
    assert gpu == EngineChoice("torch", "cuda:0", "bfloat16")
    assert any("NVIDIA H200" in r for r in gpu.reasons)
    assert any("--engine vllm to use it" in r for r in gpu.reasons)


def test_explicit_choices_are_kept() -> None:
    assert choose("vllm", "cuda:1", "float32", TWO_GPUS) == EngineChoice(
        "vllm", "cuda:1", "float32"
    )
    assert choose("torch", "cuda", None, TWO_GPUS).device == "cuda:0"
    assert choose(None, "cpu", "bfloat16", TWO_GPUS) == EngineChoice("torch", "cpu", "bfloat16")


def test_cpu_needs_no_probe() -> None:
    assert choose(device="cpu").device == "cpu"  # would probe (and fail the test) otherwise


@pytest.mark.parametrize(
    ("args", "acc", "says"),
    [
        (("vllm", None, None), NONE, "--engine vllm needs vllm"),
        (("vllm", "cpu", None), TWO_GPUS, "--engine vllm runs only on a CUDA GPU"),
        (("vllm", None, None), Accelerators((), vllm=True, note="x"), "runs only on a CUDA GPU"),
        ((None, "cuda:2", None), TWO_GPUS, "--device cuda:2 does not exist: this machine has"),
        ((None, "cuda", None), NONE, "--device cuda: this machine has no CUDA GPU"),
        ((None, "gpu0", None), TWO_GPUS, "is not cpu, cuda or cuda:N"),
        ((None, "cuda:x", None), TWO_GPUS, "is not cpu, cuda or cuda:N"),
        (("jax", None, None), TWO_GPUS, "--engine 'jax' is unknown"),
        ((None, None, "fp8"), TWO_GPUS, "--dtype 'fp8' is unknown"),
    ],
)
def test_bad_choices_are_one_line_errors_with_the_fix(
    args: tuple[str | None, str | None, str | None], acc: Accelerators, says: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        choose(*args, acc=acc)
    assert "\n" not in str(err.value)


def test_nproc_shards_a_trainer_over_devices_from_the_chosen_one() -> None:
    assert choose(device="cpu", nproc=3).nproc == 3
    assert "3 gloo ranks" in choose(device="cpu", nproc=3).reasons[-1]
    two = choose(None, "cuda:0", None, TWO_GPUS, nproc=2)
    assert two.nproc == 2 and two.reasons[-1] == "nproc 2: FSDP2 over cuda:0..cuda:1 (nccl)"
    assert check_nproc(None, "inference") == 1 and check_nproc(4, "trainer") == 4


@pytest.mark.parametrize(
    ("nproc", "role", "device", "says"),
    [
        (0, "trainer", "cpu", "--nproc 0 is not a number of processes; give 1 or more"),
        (-2, "trainer", "cpu", "--nproc -2 is not a number of processes"),
        (2, "inference", "cpu", "an inference node uses one device: drop --nproc"),
        (2, "validator", "cpu", "a validator node uses one device: drop --nproc"),
        (3, "trainer", "cuda", "--nproc 3 on cuda:0 needs 3 CUDA GPUs from cuda:0 on"),
        (2, "trainer", "cuda:1", "this machine has 2; lower --nproc or pick another --device"),
    ],
)
def test_bad_nproc_is_a_one_line_error_with_the_fix(
    nproc: int, role: str, device: str, says: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        choose(device=device, acc=TWO_GPUS, nproc=check_nproc(nproc, role))
    assert "\n" not in str(err.value)
