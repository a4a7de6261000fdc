"""The per-round metrics log of a peer that runs for days: a full disk loses lines with one warning and never stops
the peer, and the log goes on, line by whole line, once the disk has room again; a log removed under it (its
out-dir deleted) is started again rather than written into a deleted file."""

import json
import shutil
import textwrap

from murmur.peer.metrics import MetricsLog, read_metrics
from tests.diskfull import disk_full_at


def test_a_full_disk_loses_lines_with_one_warning_and_the_log_goes_on_when_it_has_room(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # in a child where a file cannot grow past 1,000 bytes (EFBIG, as a full disk fails a write), 40 rounds are
    # logged; then the limit is lifted (the disk has room again) and 5 more are
    code = textwrap.dedent(
        """
        import logging, resource, sys
        from pathlib import Path
        from murmur.peer.metrics import MetricsLog

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        log = MetricsLog(Path(sys.argv[1]))
        for i in range(40):
            log.write(round=i, pad="x" * 50)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        for i in range(40, 45):
            log.write(round=i, pad="x" * 50)
        log.close()
        print("trained on")
        """
    )
    done = disk_full_at(1000, ["-c", code, str(path)])
    assert done.returncode == 0 and done.stdout == "trained on\n", done.stderr  # the peer was not stopped
    warnings = done.stderr.splitlines()
    assert len(warnings) == 2, done.stderr  # once when lines are lost, once when they are written again
    assert warnings[0].startswith(f"WARNING {path}: a line could not be written (File too large)")
    lines = path.read_text().splitlines()
    torn = [i for i, line in enumerate(lines) if not line.endswith("}")]  # a line the full disk cut short
    rounds = [json.loads(line)["round"] for i, line in enumerate(lines) if i not in torn]
    kept = rounds.index(40)
    assert rounds == list(range(kept)) + list(range(40, 45)) and 10 < kept < 40  # the lines lost are the full disk's
    assert torn in ([], [kept])  # the next line after it stands alone
    assert warnings[1] == f"WARNING {path} is written again; {40 - kept} lines were lost"


def test_a_log_removed_while_the_peer_runs_is_started_again_where_it_was(tmp_path, caplog):
    out = tmp_path / "run"
    log = MetricsLog(out / "metrics.jsonl")
    log.write(round=1)
    shutil.rmtree(out)  # the volunteer cleans up the wrong folder while the peer trains
    log.write(round=2)
    log.write(round=3)
    log.close()
    assert [r["round"] for r in read_metrics(out / "metrics.jsonl")] == [2, 3]  # not written into a deleted file
    assert [r.getMessage() for r in caplog.records] == [
        f"{out / 'metrics.jsonl'} was removed while the peer ran; a new one is started"
    ]
