"""The live progress line of a joined peer: a pure render function, and where it is written; the download bar."""

from __future__ import annotations

import io
import logging

from murmur.peer.ops.progress import Company, Progress, ProgressLine, download_bar, render_progress

SNAPSHOT = Progress(
    round=12, step=240, loss=2.3456, eval_loss=2.5, samples_per_second=81.25, peers_seen=3, exchanges_ok=9,
    exchanges_failed=1, group=("12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA",), seconds_since_exchange=4.2,
    bytes_sent=1_234_567, bytes_received=987,
)  # fmt: skip


def test_render_shows_every_field() -> None:
    assert render_progress(SNAPSHOT) == (
        "round 12 inner step 240 | loss 2.346 eval 2.500 | 81.2 samples/s | 2 other peers | "
        "exchanges 9 ok / 1 failed, last exchange with eQAJU5SA 4s ago | sent 1.2 MB received 987 B"
    )


def test_render_names_a_group_by_its_size() -> None:
    group = ("12D3KooWAAAAAAAAAAAAAAAAaaaaaaaa", "12D3KooWBBBBBBBBBBBBBBBBbbbbbbbb", "12D3KooWCCCCCCCCCCCCCCCCcccccccc")
    line = render_progress(Progress(**{**SNAPSHOT.__dict__, "group": group}))
    assert "last exchange with 3 peers 4s ago" in line


def test_the_line_remembers_the_last_group_through_lonely_rounds() -> None:
    progress = ProgressLine(every=1, stream=io.StringIO())
    assert progress.last_exchange() == (None, None)
    progress.exchanged(("12D3KooWAAAAaaaa",))
    progress.exchanged(None)  # a lonely round
    progress.exchanged(())
    group, since = progress.last_exchange()
    assert group == ("12D3KooWAAAAaaaa",) and 0 <= since < 5


def test_render_before_any_exchange() -> None:
    line = render_progress(Progress(**{**SNAPSHOT.__dict__, "group": None, "peers_seen": 1, "exchanges_ok": 0}))
    assert "no exchange yet" in line and "no other peer yet" in line


def test_a_peer_that_saw_others_and_sees_none_says_so_once_and_once_more_when_they_are_back() -> None:
    """A link down for half a minute: the roster empties as the others' announcements expire. The line said "no
    other peer yet", as if none had come, and nothing else told the volunteer (a link taken down in a network
    namespace, scripts/netlab.py); now one line says it, and the progress line says "now"."""
    company = Company()
    assert company.update(0) is None  # alone from the start: nothing to say, "yet" is right
    line = render_progress(Progress(**{**SNAPSHOT.__dict__, "peers_seen": 1, "most_others": company.most}))
    assert "no other peer yet" in line
    assert company.update(2) is None and company.update(1) is None
    level, said = company.update(0)
    assert level == logging.WARNING and "sees no other peer of the run any more (2 before)" in said
    assert "network is down" in said and "\n" not in said
    assert company.update(0) is None  # once
    line = render_progress(Progress(**{**SNAPSHOT.__dict__, "peers_seen": 1, "most_others": company.most}))
    assert "no other peer now (2 before)" in line and "yet" not in line.split("|")[3]
    assert company.update(2) == (logging.INFO, "sees 2 other peers of the run again")
    assert company.update(2) is None


def test_a_log_gets_a_line_every_few_rounds() -> None:
    out = io.StringIO()
    progress = ProgressLine(every=5, stream=out)
    for r in range(1, 11):
        progress.show(Progress(**{**SNAPSHOT.__dict__, "round": r}))
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["5", "10"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_download_bar_shows_only_on_a_terminal() -> None:
    log = io.StringIO()
    with download_bar(log) as update:
        assert update is None  # nothing to feed: the log stays one line per event
    assert log.getvalue() == ""
    screen = Terminal()
    with download_bar(screen) as update:
        update(0, 3_000_000)
        update(3_000_000, 3_000_000)
    assert "state download" in screen.getvalue() and "3.0/3.0 MB" in screen.getvalue()


def test_a_verbose_peer_shows_each_line_it_logs_once(caplog, capsys) -> None:
    """A peer's notices go to its log, and to the progress lines' stream (`--verbose`) only where the log does not
    show their level: a warning appeared twice in a file of a peer's output, once with the log's prefix."""
    from types import SimpleNamespace

    from murmur.peer.runner import VolunteerPeer

    peer = SimpleNamespace(options=SimpleNamespace(verbose=True))
    caplog.set_level(logging.WARNING, logger="murmur.peer")
    VolunteerPeer._log(peer, logging.WARNING, "sees no other peer of the run any more")
    VolunteerPeer._log(peer, logging.INFO, "finished: 2 finish exchanges")
    assert [r.getMessage() for r in caplog.records] == ["sees no other peer of the run any more"]
    assert capsys.readouterr().out == "finished: 2 finish exchanges\n"
