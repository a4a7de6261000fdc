"""A fresh virtualenv with only `pip install .`: do the commands run, with no module missing?

Makes a new venv in a temporary folder, installs the pinned CPU torch (as the Makefile does: an
unpinned one pulls a CUDA build) and then `pip install .` (not editable, no extras), and from a
folder outside the repository (so that the repository's own peer/, dht/ and averaging/ cannot be
imported by accident) runs:

* `murmur simulate --peers 2 --duration 15`
* `murmur report` on the simulation's folder
* `murmur dashboard` against a bootstrap node, fetching its page, script and /api/state once
* `python scripts/simulate_scale.py --quick`

and checks what landed in site-packages: `murmur/` and the dist-info, nothing named peer, dht or
averaging. Prints one line per check and exits 1 if any failed. Takes a few minutes (the installs).

    python scripts/check_install.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
SOURCES = ("peer", "dht", "averaging")  # the folders installed as murmur.peer, murmur.dht and murmur.averaging


def run(argv: list[str], cwd: Path, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, **kwargs)


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def tail(proc: subprocess.CompletedProcess) -> str:
    return " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])


def dashboard(bin_dir: Path, work: Path) -> tuple[bool, str]:
    """A bootstrap node and a dashboard on it; the page, its script and its state answer."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    boot = subprocess.Popen([str(bin_dir / "murmur"), "bootstrap", "--run", "check"], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    dash = None
    try:
        line = boot.stdout.readline()
        found = re.search(r"--initial-peers (\S+)", line)
        if not found:
            return False, f"bootstrap printed {line!r}"
        dash = subprocess.Popen(
            [str(bin_dir / "murmur"), "dashboard", "--initial-peers", found.group(1), "--run", "check", "--port", "0"],
            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        url = re.search(r"at (http://\S+)", dash.stdout.readline())
        if not url:
            return False, f"dashboard did not start: {dash.stderr.read()[-300:]}"
        page = urllib.request.urlopen(url.group(1), timeout=10).read().decode()
        script = urllib.request.urlopen(url.group(1) + "dashboard.js", timeout=10).read().decode()
        time.sleep(3)
        state = json.loads(urllib.request.urlopen(url.group(1) + "api/state", timeout=10).read())
        ok = "<canvas" in page and "drawChart" in script and state["run"] == "check" and state["config"] is not None
        return ok, f"page {len(page)} B, script {len(script)} B, config {'read' if state['config'] else 'missing'}"
    finally:
        for proc in (dash, boot):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)


def source(folder: Path) -> Path:
    """What the distribution is built from, copied out of the repository (pip builds in the source tree)."""
    for name in (*SOURCES, "setup.cfg", "pyproject.toml", "README.md"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, folder / name)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", type=Path, help="make the venv here and keep it (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="murmur-install-") as tmp:
        root = args.keep or Path(tmp)
        venv, work = root / "venv", root / "work"
        work.mkdir(parents=True, exist_ok=True)
        bin_dir = venv / "bin"
        python = bin_dir / "python"
        started = time.monotonic()
        steps = [([sys.executable, "-m", "venv", str(venv)], 120),
                 ([str(python), "-m", "pip", "install", "-q", TORCH], 900),
                 ([str(python), "-m", "pip", "install", "-q", str(source(root / "src"))], 900)]  # fmt: skip
        for argv, timeout in steps:
            proc = run(argv, work, timeout)
            if not check(" ".join(argv[2:]) if "pip" in argv else "venv", proc.returncode == 0, tail(proc)):
                return 1
        print(f"     installed in {time.monotonic() - started:.0f} s", flush=True)
        site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work,
                        60).stdout.strip())  # fmt: skip
        ours = sorted(p.name for p in site.iterdir() if p.name in {"murmur", "peer", "dht", "averaging"})
        results = [check("site-packages holds murmur/ and none of peer, dht, averaging", ours == ["murmur"], str(ours))]

        proc = run([str(bin_dir / "murmur"), "simulate", "--peers", "2", "--duration", "15", "--report", "r.json"],
                   work, 600)  # fmt: skip
        results.append(check("murmur simulate", proc.returncode == 0 and (work / "r.json").exists(), tail(proc)))
        proc = run([str(bin_dir / "murmur"), "report", "runs/sim"], work, 120)
        results.append(check("murmur report", proc.returncode == 0, tail(proc)))
        ok, detail = dashboard(bin_dir, work)
        results.append(check("murmur dashboard", ok, detail))
        proc = run([str(python), str(REPO / "scripts" / "simulate_scale.py"), "--quick", "--out", str(work / "scale")],
                   work, 900)  # fmt: skip
        results.append(check("scripts/simulate_scale.py --quick", proc.returncode == 0, tail(proc)))
        print(f"{sum(results)}/{len(results)} checks passed in {time.monotonic() - started:.0f} s")
        return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
