"""A machine whose clock is off: with MURMUR_TEST_CLOCK_SKEW=S set and this folder on PYTHONPATH, every Python
process started so (and the processes it forks, hivemind's DHT worker among them) reads time.time() S seconds
ahead of the machine's (behind for a negative S). For tests/test_clock.py only."""

import os
import time

_skew = float(os.environ.get("MURMUR_TEST_CLOCK_SKEW") or 0)
if _skew:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew
    time.time_ns = lambda: _time_ns() + int(_skew * 1e9)
