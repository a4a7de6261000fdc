"""Private runs: an unauthorized peer is refused with a clear reason and never receives model data."""

import asyncio
import logging
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


def pair(policy_a: AccessPolicy, policy_b: AccessPolicy, rounds: int = 1, sent: dict | None = None):
    """A asks B to average, each under its own policy, `rounds` times; returns the first round's results, A,
    the messages B sent (and in `sent`, by sender, every message), and B."""

    async def main():
        net = InMemoryNetwork()
        sent_by = {"A": [], "B": []}

        async def record(src, dst, frame):
            sent_by[src].append(wire.decode(frame))
            return frame

        net.before_send = record
        a = make_averager(net, "A", ["B"], replace(FAST, access=policy_a, retry_after=(5.0, 5.0)))
        b = make_averager(net, "B", [], replace(FAST, access=policy_b))
        await started(a, b)
        results = [await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2))) for _ in range(rounds)]
        return results[0], a, sent_by["B"], sent_by, b

    results, a, sent_by_b, sent_by, b = asyncio.run(main())
    if sent is not None:
        sent.update(sent_by, b=b)
    return results, a, sent_by_b


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


def test_an_impostor_responder_is_caught_before_we_send_model_data(caplog):
    caplog.set_level(logging.WARNING, logger="murmur.averaging")
    sent = {}
    (ra, rb), a, sent_by_b = pair(AccessPolicy(secret=SECRET), AccessPolicy(), rounds=4, sent=sent)  # B proves nothing
    assert ra is None and "access check" in a.stats.last_error
    assert [m.kind for m in sent["A"]] == [wire.Kind.REQUEST] * 2, "asked twice, then on cool-down"
    assert all(not m.tensors for m in sent["A"] + sent["B"]), "no tensor moves before both proofs are checked"
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refusals == [
        "peer B refused: it failed the access check as a partner "
        "(not authorized: this run is private and the request carries no proof of its secret)"
    ]
    assert a.cooldown.cooling("B")


def test_an_outsider_that_keeps_asking_is_refused_once_in_the_log_and_cooled_down(caplog):
    caplog.set_level(logging.WARNING, logger="murmur.averaging")
    sent = {}
    pair(AccessPolicy(), AccessPolicy(secret=SECRET), rounds=3, sent=sent)  # A, the outsider, asks every round
    reasons = [m.meta["reason"] for m in sent["B"]]
    assert [m.kind for m in sent["B"]] == [wire.Kind.DECLINE] * 3 and all(not m.tensors for m in sent["B"])
    assert reasons[-1] == "cooling down after bad messages" and "not authorized" in reasons[0]
    assert len([r for r in caplog.records if "peer A refused" in r.getMessage()]) == 1
    assert sent["b"].cooldown.cooling("A")


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
