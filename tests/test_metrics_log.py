"""The per-round metrics log of a peer that runs for days: a full disk loses lines with one warning and never stops
the peer, and the log goes on, line by whole line, once the disk has room again."""

import json
import textwrap

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
