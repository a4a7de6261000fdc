"""Private runs: an unauthorized peer is refused with a clear reason and never receives model data."""

import asyncio
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from averaging import wire
from averaging.access import AccessError, AccessPolicy, load_policy
from averaging.transport import InMemoryNetwork
from tests.test_exchange import FAST, make_averager, make_offer, started

SECRET = b"correct horse battery staple"


def pair(policy_a: AccessPolicy, policy_b: AccessPolicy):
    """A asks B to average, each under its own policy; returns both results, B and the kinds B sent."""

    async def main():
        net = InMemoryNetwork()
        sent_by_b = []

        async def record(src, dst, frame):
            if src == "B":
                sent_by_b.append(wire.decode(frame))
            return frame

        net.before_send = record
        a = make_averager(net, "A", ["B"], replace(FAST, access=policy_a))
        b = make_averager(net, "B", [], replace(FAST, access=policy_b))
        await started(a, b)
        results = await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))
        return results, a, sent_by_b

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("policy_a", "reason"),
    [
        (AccessPolicy(), "no proof of its secret"),
        (AccessPolicy(secret=b"a wrong secret, 16+ bytes"), "wrong run secret"),
        (AccessPolicy(secret=SECRET, clock=lambda: 0.0), "stale"),
    ],
    ids=["no-secret", "wrong-secret", "replayed-proof"],
)
def test_a_peer_without_the_secret_is_refused_and_gets_no_model_data(policy_a, reason):
    (ra, rb), a, sent_by_b = pair(policy_a, AccessPolicy(secret=SECRET))
    assert ra is None and rb is None
    assert [m.kind for m in sent_by_b] == [wire.Kind.DECLINE] * len(sent_by_b) and sent_by_b
    assert all(not m.tensors for m in sent_by_b), "a refused peer must receive no tensors"
    assert reason in sent_by_b[0].meta["reason"] and "not authorized" in sent_by_b[0].meta["reason"]
    assert a.stats.declined >= 1


def test_peers_with_the_secret_exchange_and_the_secret_never_travels():
    (ra, rb), a, sent_by_b = pair(AccessPolicy(secret=SECRET), AccessPolicy(secret=SECRET))
    assert ra is not None and rb is not None
    assert all(SECRET.decode() not in str(m.meta) for m in sent_by_b)


def test_an_allowlist_refuses_others_and_admits_its_peers():
    (ra, rb), _, sent_by_b = pair(AccessPolicy(), AccessPolicy(allowed=frozenset({"C"})))
    assert ra is None and "allowlist" in sent_by_b[0].meta["reason"]
    (ra, rb), _, _ = pair(AccessPolicy(allowed=frozenset({"B"})), AccessPolicy(allowed=frozenset({"A"})))
    assert ra is not None and rb is not None


def test_an_impostor_responder_is_caught_before_we_send_model_data():
    (ra, rb), a, sent_by_b = pair(AccessPolicy(secret=SECRET), AccessPolicy())  # B does not check, nor prove
    assert ra is None and "access check" in a.stats.last_error


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
    good = tmp_path / "secret"
    good.write_bytes(SECRET + b"\n")
    assert load_policy(good, ["QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"]).secret == SECRET


def test_cli_rejects_a_bad_secret_file_in_one_line(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "peer.cli", "bootstrap", "--run", "r", "--run-secret-file", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "cannot read run secret file" in proc.stderr
