"""`murmur doctor`: each check's verdict from what it is shown, and the whole command on this machine."""

from __future__ import annotations

import socket

import pytest

from murmur.peer.cli import main
from murmur.peer.device import Capabilities
from murmur.peer.ops.doctor import CUDA_INSTALL, Level, check_p2pd, check_port, check_reachability, check_torch


def test_a_busy_port_fails_with_a_fix() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        verdict = check_port("127.0.0.1", port)
    assert verdict.level == Level.FAIL and f"127.0.0.1:{port} is in use" in verdict.detail
    assert "--port" in verdict.fix
    assert check_port("127.0.0.1", port).level == Level.OK  # released: free again


def test_a_host_this_machine_lacks_fails_with_a_fix() -> None:
    """With port 0 doctor said "ok" for any --host, and murmur join then failed to listen there."""
    for port in (0, 5000):
        verdict = check_port("192.0.2.1", port)  # TEST-NET-1: no interface has it
        assert verdict.level == Level.FAIL and verdict.detail.startswith("192.0.2.1 cannot be listened on: ")
        assert "--host" in verdict.fix
    assert check_port("0.0.0.0", 0).level == Level.OK


@pytest.mark.parametrize(
    ("addresses", "level"),
    [
        (["127.0.0.1", "::1", "10.1.2.3", "192.168.0.7", "fe80::1%eth0", "172.16.5.5"], Level.WARN),
        (["127.0.0.1", "100.64.0.1"], Level.WARN),  # carrier-grade NAT is not reachable either
        (["127.0.0.1", "10.0.0.2", "8.8.4.4"], Level.OK),
        (["2001:4860::8888"], Level.OK),
    ],
)
def test_reachability_is_decided_from_addresses(addresses: list[str], level: Level) -> None:
    verdict = check_reachability(addresses)
    assert verdict.level == level
    assert ("--client-mode" in (verdict.fix or "")) == (level == Level.WARN)


def test_torch_verdicts() -> None:
    gpu = Capabilities(cuda=True, bf16=True, name="RTX 4090", free_bytes=20 * 2**30)
    ok = check_torch(gpu, "2.13.0+cu128", "12.8")
    assert ok.level == Level.OK and "RTX 4090, 20.0 GiB free" in ok.detail and "bf16" in ok.detail
    cpu = check_torch(Capabilities(), "2.13.0+cpu", None)
    assert cpu.level == Level.WARN and CUDA_INSTALL in cpu.fix
    blind = check_torch(Capabilities(), "2.13.0+cu128", "12.8")
    assert blind.level == Level.WARN and "nvidia-smi" in blind.fix


def test_p2pd_that_does_not_start_fails_with_a_fix() -> None:
    def broken():
        raise RuntimeError("p2pd: exec format\\nerror")

    verdict = check_p2pd(start=broken)
    assert verdict.level == Level.FAIL and "exec format" in verdict.detail and "hivemind" in verdict.fix
    assert "\n" not in verdict.detail


@pytest.mark.slow
def test_doctor_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    """A real p2pd starts and stops; a port held by someone else fails the whole command."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code = main(["doctor", "--port", str(s.getsockname()[1])])
    out = capsys.readouterr().out
    assert code == 1
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert [line.split("]")[1].split(":")[0].strip() for line in lines] == ["p2pd", "port", "torch", "reachability"]
    assert lines[0].startswith("[  ok] p2pd: a node started") and lines[1].startswith("[FAIL] port")
    assert main(["doctor"]) == 0
    assert "[  ok] port" in capsys.readouterr().out
