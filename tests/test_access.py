"""Private runs: an unauthorized peer is refused with a clear reason and never receives model data."""

import asyncio
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from murmur.averaging import wire
from murmur.averaging.access import AccessError, AccessPolicy, load_policy
from murmur.averaging.transport import InMemoryNetwork
from tests.groupkit import FAST, led_by, make_averager, make_offer, started

SECRET = b"correct horse battery staple"
PRIVATE = AccessPolicy(secret=SECRET)
QUICK = replace(FAST, exchange_timeout=1.0)  # a group whose pair stream was refused waits this long


def group(policies: dict[str, AccessPolicy], window: float = 0.3):
    """One round of a group led by the first peer in `policies` (the rest join in order), each peer under its own
    policy: the results by peer, the averagers, and every frame sent as (src, dst, raw bytes, message)."""

    async def main():
        net = InMemoryNetwork()
        frames = []

        async def record(src, dst, frame):
            frames.append((src, dst, frame, wire.decode(frame)))
            return frame

        net.before_send = record
        peers = await started(*(make_averager(net, name, replace(QUICK, access=p)) for name, p in policies.items()))
        leader, *members = policies
        plan_of = led_by(leader, members, window=window)
        results = await asyncio.gather(*(p.average(make_offer(i), plan_of[p.peer_id]) for i, p in enumerate(peers)))
        return dict(zip(policies, results, strict=True)), {p.peer_id: p for p in peers}, frames

    return asyncio.run(main())


def tensors_to(frames, peer: str) -> list[str]:
    """The kinds of the frames that carried tensors to `peer`."""
    return [m.kind.name for _, dst, _, m in frames if dst == peer and m.tensors]


@pytest.mark.parametrize(
    ("outsider", "reason"),
    [
        (AccessPolicy(), "no proof of its secret"),
        (AccessPolicy(secret=b"a wrong secret, 16+ bytes"), "wrong run secret"),
        (AccessPolicy(secret=SECRET, clock=lambda: 0.0), "stale"),
    ],
    ids=["no-secret", "wrong-secret", "replayed-proof"],
)
def test_a_peer_without_the_secret_is_refused_and_gets_no_model_data(outsider, reason):
    results, peers, frames = group({"L": PRIVATE, "M": PRIVATE, "X": outsider})
    assert results["X"] is None and results["L"] is not None and results["L"].members == ("L", "M")
    to_x = [m for _, dst, _, m in frames if dst == "X"]
    assert [m.kind for m in to_x] == [wire.Kind.DECLINE], "the leader answers the outsider's JOIN, and nobody else"
    assert tensors_to(frames, "X") == [], "a refused peer must receive no tensors"
    assert "not authorized" in to_x[0].meta["reason"] and reason in to_x[0].meta["reason"]
    assert peers["X"].stats.declined == 1


def test_peers_with_the_secret_average_and_the_secret_never_travels():
    results, _, frames = group({"L": PRIVATE, "M": PRIVATE, "N": PRIVATE})
    assert all(r is not None and r.members == ("L", "M", "N") for r in results.values())
    assert {m.kind for *_, m in frames} >= {wire.Kind.JOIN, wire.Kind.ROSTER, wire.Kind.HELLO, wire.Kind.PHASE1}
    assert all(SECRET not in raw for _, _, raw, _ in frames)
    proofs = [m for *_, m in frames if m.kind in (wire.Kind.JOIN, wire.Kind.ROSTER, wire.Kind.HELLO)]
    assert all("auth" in m.meta for m in proofs), "every first message and the roster prove the secret"


def test_an_allowlist_refuses_others_and_admits_its_peers():
    listed = AccessPolicy(allowed=frozenset({"L", "M"}))
    results, _, frames = group({"L": listed, "M": listed, "X": AccessPolicy()})
    assert results["X"] is None and results["L"] is not None and results["L"].members == ("L", "M")
    assert tensors_to(frames, "X") == []
    (decline,) = [m for _, dst, _, m in frames if dst == "X"]
    assert decline.kind == wire.Kind.DECLINE and "allowlist" in decline.meta["reason"]


def test_an_impostor_leader_is_caught_before_a_member_sends_model_data():
    results, peers, frames = group({"I": AccessPolicy(), "M": PRIVATE, "N": PRIVATE})  # I neither checks nor proves
    assert all(r is None for r in results.values())
    sent = [m for src, _, _, m in frames if src in ("M", "N")]
    assert [m.kind for m in sent].count(wire.Kind.JOIN) == 2
    assert [m.kind.name for m in sent if m.tensors] == [], "members send no model data to an impostor"
    assert all("access check" in peers[p].stats.last_error for p in ("M", "N"))


@pytest.mark.parametrize(
    "order",
    [("X", "M"), ("M", "X")],
    ids=["outsider-opens-the-link", "member-opens-the-link"],
)
def test_a_member_sends_no_model_data_to_a_roster_member_off_its_allowlist(order):
    """The leader admits X; member M's own allowlist does not. Whoever opens their pair stream, M sends X nothing."""
    policies = {"L": AccessPolicy(), order[0]: AccessPolicy(), order[1]: AccessPolicy()}
    policies["M"] = AccessPolicy(allowed=frozenset({"L"}))
    results, _, frames = group(policies)
    assert [m.kind.name for src, dst, _, m in frames if src == "M" and dst == "X" and m.tensors] == []
    assert results["M"] is None
    from_m = [m for src, dst, _, m in frames if src == "M" and dst == "L" and m.kind == wire.Kind.ABORT]
    assert from_m and all("allowlist" in m.meta.get("reason", "") for m in from_m), "M tells its leader why it leaves"


def test_an_outsider_that_keeps_joining_is_refused_once_in_the_log_and_cooled_down(caplog):
    async def main():
        net = InMemoryNetwork()
        sent = []

        async def record(src, dst, frame):
            sent.extend([wire.decode(frame)] if src == "L" and dst == "X" else [])
            return frame

        net.before_send = record
        leader, outsider = await started(make_averager(net, "L", replace(QUICK, access=PRIVATE)),
                                         make_averager(net, "X", QUICK))  # fmt: skip
        for _ in range(3):  # the outsider asks every round
            plan_of = led_by("L", ["X"], window=0.2)
            rounds = leader.average(make_offer(1), plan_of["L"]), outsider.average(make_offer(2), plan_of["X"])
            await asyncio.gather(*rounds)
        return leader, sent

    caplog.set_level(logging.WARNING, logger="murmur.averaging")
    leader, sent = asyncio.run(main())
    reasons = [m.meta["reason"] for m in sent]
    assert [m.kind for m in sent] == [wire.Kind.DECLINE] * 2 and all(not m.tensors for m in sent)
    assert all("not authorized" in r for r in reasons)
    assert leader.transport.gate.refused == 1  # on cool-down after two: its third stream is not even read
    assert len([r for r in caplog.records if "peer X refused" in r.getMessage()]) == 1
    assert leader.cooldown.cooling("X")


def test_the_run_record_tells_a_joiner_that_the_run_is_private():
    run = AccessPolicy(secret=SECRET)
    check = run.run_check("my-run")
    assert check is not None and SECRET.hex() not in check and AccessPolicy().run_check("my-run") is None
    assert run.refuses_run("my-run", check) is None and AccessPolicy().refuses_run("my-run", None) is None
    assert AccessPolicy().refuses_run("my-run", check) == (
        "run 'my-run' is private: pass --run-secret-file FILE with the run's secret"
    )
    wrong = AccessPolicy(secret=b"another secret of 16+ bytes")
    assert "is not its secret" in wrong.refuses_run("my-run", check)
    assert run.refuses_run("other-run", check) is not None  # a check is for one run only


def test_the_policy_is_a_callable_check_for_other_handlers():
    server, client = AccessPolicy(secret=SECRET), AccessPolicy(secret=SECRET)
    meta = client.credentials(context="state-download", local="C", remote="S", nonce=7)
    assert server.check(context="state-download", local="S", remote="C", nonce=7, meta=meta) is None
    assert server.check(context="state-download", local="S", remote="C", nonce=8, meta=meta) == (
        "not authorized: wrong run secret"
    )
    assert server.check(context="exchange-request", local="S", remote="C", nonce=7, meta=meta) is not None


def test_load_policy_errors_are_one_line(tmp_path: Path):
    short = tmp_path / "short"
    short.write_bytes(b"abc\n")
    for path, match in [(tmp_path / "missing", "cannot read"), (short, "fewer than 16 bytes")]:
        with pytest.raises(AccessError, match=match) as e:
            load_policy(path, None)
        assert "\n" not in str(e.value)
    with pytest.raises(AccessError, match="not a peer id"):
        load_policy(None, ["not/a peer"])
    # base58 that is no peer id: a made-up name, a real id with its last character lost
    for typo in ["notapeer", "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJ"]:
        with pytest.raises(AccessError, match=f"--allow-peers: bad peer id '{typo}': it is not a base58 peer id"):
            load_policy(None, ["QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN", typo])
    good = tmp_path / "secret"
    good.write_bytes(SECRET + b"\n")
    assert load_policy(good, ["QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"]).secret == SECRET


def test_cli_rejects_a_bad_secret_file_in_one_line(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "murmur.peer.cli", "bootstrap", "--run", "r", "--run-secret-file",
         str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "cannot read run secret file" in proc.stderr
