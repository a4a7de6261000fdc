"""What a peer's processes hold beyond what it uses: a real DHT node starts, stores and reads without hivemind's
averager, optimizer or scipy (dht/lazy_hivemind.py), and without a torch_shm_manager process (dht/node.py shares
its futures' memory by file descriptor); code that asks hivemind's root for its names gets them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(code: str) -> str:
    """`code` in a fresh process, in a user's environment (not the suite's own choice of memory sharing)."""
    env = {k: v for k, v in os.environ.items() if k != "HIVEMIND_MEMORY_SHARING_STRATEGY"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_a_peer_runs_a_real_dht_node_without_the_rest_of_hivemind() -> None:
    out = run("""
        import sys
        import psutil
        import murmur.peer.runner  # everything a peer imports
        from murmur.dht.lazy_hivemind import is_light
        from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses
        from hivemind.utils import get_dht_time

        first = start_node(NodeConfig())
        second = start_node(NodeConfig(initial_peers=tuple(visible_addresses(first))))
        try:
            assert first.store("key", "value", get_dht_time() + 30)
            found = second.get("key", latest=True)
            assert found is not None and found.value == "value", found
            children = sorted({child.name() for child in psutil.Process().children(recursive=True)})
        finally:
            stop_node(second)
            stop_node(first)
        left_out = [m for m in ("scipy", "hivemind.averaging", "hivemind.moe", "hivemind.optim") if m in sys.modules]
        print(is_light(), left_out, children)
    """)
    assert out.splitlines()[-1] == "True [] ['p2pd', 'python']"


def test_the_roots_own_names_are_imported_from_their_modules_where_asked_for() -> None:
    out = run("""
        import sys
        import murmur.dht
        import hivemind
        from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager  # its modules use hivemind.DHT
        from murmur.dht.lazy_hivemind import is_light

        from hivemind import Optimizer
        print(is_light(), hivemind.__version__, hivemind.DHT is hivemind.dht.DHT, Optimizer.__module__,
              PowerSGDGradientAverager.__module__, "DecentralizedAverager" in dir(hivemind))
        try:
            hivemind.nothing_of_the_kind
        except AttributeError as e:
            print(e)
    """)
    assert out.splitlines()[-2:] == [
        "True 1.1.12 True hivemind.optim.optimizer hivemind.optim.power_sgd_averager True",
        "module 'hivemind' has no attribute 'nothing_of_the_kind'",
    ]


def test_an_init_that_does_more_than_import_names_is_left_to_run(tmp_path) -> None:
    from murmur.dht.lazy_hivemind import names_of

    init = tmp_path / "__init__.py"
    init.write_text('"""doc"""\nfrom hivemind.dht import DHT as D, get_dht_time\n__version__ = "9"\n')
    assert names_of(init) == (
        {"D": ("hivemind.dht", "DHT"), "get_dht_time": ("hivemind.dht", "get_dht_time")},
        {"__doc__": "doc", "__version__": "9"},
    )
    for other in ("import os\n", "from hivemind.dht import *\n", "from .dht import DHT\n", "x = f()\n", "def ("):
        init.write_text(other)
        assert names_of(init) is None, other


def test_a_process_that_imported_hivemind_first_keeps_it_whole() -> None:
    out = run("""
        import hivemind
        import murmur.peer
        from murmur.dht.lazy_hivemind import is_light
        print(is_light(), hivemind.DHT.__name__)
    """)
    assert out.splitlines()[-1] == "False DHT"


@pytest.mark.slow
@pytest.mark.concurrent
def test_footprint_measures_a_real_peer(tmp_path) -> None:
    out = tmp_path / "footprint.json"
    done = subprocess.run([sys.executable, "scripts/footprint.py", "--peers", "1", "--seconds", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["processes_per_peer"] == {"dht worker": 1.0, "p2pd": 1.0, "peer": 1.0}  # no torch_shm_manager
    assert 0 < result["per_peer_mb"]["uss_mb"] <= result["per_peer_mb"]["pss_mb"] <= result["per_peer_mb"]["rss_mb"]
    assert len(result["start_seconds"]) == 1 and result["start_cpu_seconds"][0] > 0
    assert "a peer: RSS" in done.stdout
    bad = subprocess.run([sys.executable, "scripts/footprint.py", "--peers", "0"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)  # fmt: skip
    assert bad.returncode == 2 and "--peers" in bad.stderr.strip().splitlines()[-1]
