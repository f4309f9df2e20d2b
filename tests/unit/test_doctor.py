from __future__ import annotations

import socket
from pathlib import Path

from node.doctor import check_bootstrap, check_key, check_ports, run_checks
from node.home import NodeHome


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_busy_port_fails_with_a_hint() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        [check] = check_ports((f"/ip4/127.0.0.1/tcp/{port}",))
    assert check.status == "fail" and "--listen" in check.hint
    assert check_ports((f"/ip4/127.0.0.1/tcp/{_free_port()}",))[0].status == "ok"


def test_unreachable_bootstrap_fails_and_an_empty_list_warns() -> None:
    [check] = check_bootstrap((f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/x",), timeout=1.0)
    assert check.status == "fail" and check.hint
    assert check_bootstrap(())[0].status == "warn"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        addr = f"/ip4/127.0.0.1/tcp/{server.getsockname()[1]}/p2p/x"
        assert check_bootstrap((addr,))[0].status == "ok"


def test_key_checks_say_to_init_and_then_pass(tmp_path: Path) -> None:
    home = NodeHome(tmp_path / "h")
    assert check_key(home).status == "fail" and "init" in check_key(home).hint
    home.create()
    assert check_key(home).status == "ok"
    names = [c.name for c in run_checks(home, ())]
    assert {"software", "key", "disk", "memory", "accelerator"} <= set(names)


def test_doctor_says_which_engine_device_and_dtype_join_would_pick_and_why() -> None:
    from node.compute.devices import Accelerators
    from node.doctor import check_accelerator

    found, picked, ranks = check_accelerator(
        Accelerators((), False, "no NVIDIA device on this machine")
    )
    assert found.status == "warn" and "no NVIDIA device" in found.detail
    assert "--nproc N" in ranks.detail and "gloo" in ranks.detail
    assert picked.detail == "torch on cpu in float32"
    assert "bf16 is slow on CPUs" in picked.hint and "--device" in picked.hint
    _, gpu, gpu_ranks = check_accelerator(Accelerators(("NVIDIA H200",) * 2, True, "torch 2.11"))
    assert gpu.detail == "torch on cuda:0 in bfloat16" and "--engine vllm" in gpu.hint
    assert "up to 2 here" in gpu_ranks.detail and "nccl" in gpu_ranks.detail
