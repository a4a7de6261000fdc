"""The README and docs/: every relative link and anchor resolves, every file of the repository they name exists,
and example peer ids are ones our keys make."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"`((?:averaging|dht|docs|examples|peer|scripts|tests)/[\w./-]*)`")  # `scripts/results/x.txt`


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        if m := re.match(r"#+ (.*)", line):
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_named_exists(page: Path) -> None:
    """The README cited `scripts/results/simulate_scale_quick_sketch.txt` for a figure; no such file was ever
    committed."""
    missing = [path for path in REPO_PATH.findall(page.read_text()) if not (ROOT / path).exists()]
    assert not missing, f"{page.name}: {missing}"


def test_the_readme_opens_with_the_two_commands_then_the_journeys() -> None:
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```")[1]
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "simulate"], ["make", "test"]]
    headings = re.findall(r"(?m)^## (.*)$", text)
    assert headings[:2] == ["Three journeys", "Results"]
    assert {"The volunteer", "The operator", "The researcher"} <= set(re.findall(r"(?m)^### (.*)$", text))


def test_example_peer_ids_have_the_shape_of_ours(tmp_path: Path) -> None:
    from hivemind.p2p import PeerID

    from murmur.dht.identity import ensure_identity, peer_id_of

    ours = peer_id_of(ensure_identity(tmp_path / "key"))  # a key file as `--identity` makes one
    for page in PAGES:
        for peer_id in re.findall(r"/p2p/([A-Za-z0-9]+)", page.read_text()):
            assert len(peer_id) == len(ours) and peer_id[:2] == ours[:2], (page.name, peer_id)
            PeerID.from_base58(peer_id)  # decodes
