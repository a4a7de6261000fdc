"""Every case of `scripts/bad_input.py` through the real command: its exact line, exit code, and data intact.

The cases are the issue's classes of bad input (work that is lost, runs that silently do nothing,
messages that mislead); each runs `python -m murmur.peer.cli ...` in its own process group against real
bootstrap nodes on 127.0.0.1, and every process is stopped by its group when the case ends.
"""

import pytest

from scripts.bad_input import Lab, cases, check

# the cases wait on their commands' own output, with time to spare: they may share the CPUs with another test
pytestmark = [pytest.mark.slow, pytest.mark.concurrent]
CASES = cases()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("bad-input")).start()
    # the suite shares two cores with other work (another test's peers among it): a command that answers at once
    # still waits for a core. That nothing heavy is imported for --help, a bad flag or report is checked exactly in
    # test_cli; a Ctrl-C that hung (as one in torch's manager handshake once did) still runs into the 30 s wait.
    lab.answer_within = 4.0
    yield lab
    lab.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_and_loses_nothing(lab, case):
    outcome = case.run(lab)
    assert check(case, lab, outcome) == [], outcome
