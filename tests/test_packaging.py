"""What `pip install murmur-train` installs and what the code imports: exactly what setup.cfg declares.

The repository keeps its top-level folders peer/, dht/ and averaging/; setup.cfg's package_dir installs
them as murmur.peer, murmur.dht and murmur.averaging, so nothing named peer, dht or averaging lands in
someone else's site-packages. Every third-party module imported anywhere (inside functions too) must
come from a declared distribution, and every declared distribution must be imported.
"""

from __future__ import annotations

import ast
import configparser
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from scripts import check_install

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = check_install.SOURCES  # installed as murmur.<name>
# the repository's own: the namespace, its folders, and the scripts (which import each other as scripts)
LOCAL = {"murmur", "tests", "examples", "scripts"} | {p.stem for p in (ROOT / "scripts").glob("*.py")}


def setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def requirements(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(canonical(re.match(r"[A-Za-z0-9_.-]+", line).group(0)))
    return names


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported(folders: list[Path]) -> dict[str, set[str]]:
    """Top-level third-party module name -> the files that import it (absolute imports anywhere in a file)."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in LOCAL:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def distributions(modules: dict[str, set[str]]) -> set[str]:
    owners = metadata.packages_distributions()
    missing = {m: sorted(files)[:2] for m, files in modules.items() if m not in owners}
    assert not missing, f"imported but installed by no distribution: {missing}"
    return {canonical(owners[m][0]) for m in modules}


def test_the_code_imports_exactly_the_declared_dependencies() -> None:
    declared = requirements(setup_cfg()["options"]["install_requires"])
    used = distributions(imported([ROOT / p for p in PACKAGES] + [ROOT / "scripts"]))
    assert used - declared == set(), "imported but not declared in install_requires"
    assert declared - used == set(), "declared in install_requires but never imported"


def test_the_tests_import_only_declared_dependencies_and_test_extras() -> None:
    config = setup_cfg()
    declared = requirements(config["options"]["install_requires"]) | requirements(
        config["options.extras_require"]["test"]
    )
    used = distributions(imported([ROOT / "tests", ROOT / "examples"]))
    assert used - declared == set(), "the tests import what neither install_requires nor the test extra declares"


def test_the_entry_point_and_the_packages_are_under_murmur() -> None:
    options = setup_cfg()["options"]
    packages = options["packages"].split()
    assert packages and all(p.startswith("murmur.") for p in packages)
    found = sorted("murmur." + str(p.parent.relative_to(ROOT)).replace("/", ".")
                   for name in PACKAGES for p in (ROOT / name).rglob("__init__.py"))  # fmt: skip
    assert sorted(packages) == found  # every subpackage is listed: none is left out of a wheel
    assert "murmur = murmur.peer.cli:main" in setup_cfg()["options.entry_points"]["console_scripts"]


@pytest.mark.slow
def test_the_wheel_installs_only_murmur(tmp_path: Path) -> None:
    source = check_install.source(tmp_path / "src")  # what a distribution is built from, as the script copies it
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source)]
    proc = subprocess.run([*argv, "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("murmur_train-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"murmur", wheel.name.split("-py3")[0] + ".dist-info"}
    for path in ("murmur/peer/cli.py", "murmur/dht/records.py", "murmur/averaging/wire.py",
                 "murmur/peer/ops/web/index.html", "murmur/peer/ops/web/dashboard.js"):  # fmt: skip
        assert path in names
    assert not any(n.startswith("murmur/__init__") for n in names)  # a namespace package: nothing of its own
