"""hivemind's package root as a lazy package: each of its names imported from its module when first asked for.

``hivemind/__init__.py`` imports everything hivemind ships before any of its modules can be imported: its
averager, its mixture of experts, its optimizer and, through the averager's load balancing, scipy. A peer
uses the DHT, the p2p daemon and a few utilities, none of which needs the rest. With the lazy root, each
process of a peer (the peer, and the DHT worker forked from it) holds about 46 MB less resident memory and
starts about 0.3 CPU-seconds sooner (both measured on this project's CPU machine; tests/test_footprint.py
checks what is left out).

``install`` reads hivemind's ``__init__`` (without running it) and puts in ``sys.modules`` a module for the
package made from its own spec, with a ``__getattr__`` (PEP 562) that imports each of the root's names from
the module the ``__init__`` imports it from, when first asked for: ``hivemind.DHT`` imports ``hivemind.dht``,
``from hivemind import Optimizer`` imports ``hivemind.optim``, as they always did. Its constants
(``__version__``) are set at once. ``import hivemind.dht`` imports ``hivemind.dht`` and what it imports,
nothing else. An ``__init__`` that does anything but import names from hivemind's modules and set constants
(another hivemind version) is left to run as it is, and so is a package imported before murmur's: every
murmur package installs the lazy root first thing (``murmur.dht``, ``murmur.averaging``, ``murmur.peer``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

_ROOT = "hivemind"
_lock = threading.Lock()


def install() -> None:
    """Make ``hivemind``'s root lazy in this process, unless it is imported already, not installed, or its
    ``__init__`` does more than import names and set constants."""
    with _lock:
        if _ROOT in sys.modules:
            return
        spec = importlib.util.find_spec(_ROOT)
        if spec is None or spec.origin is None or spec.submodule_search_locations is None:
            return  # not installed, or not a package: the first real import says so
        root_names = names_of(Path(spec.origin))
        if root_names is None:
            return
        imported, constants = root_names
        root = importlib.util.module_from_spec(spec)
        root.__dict__.update(constants)

        def __getattr__(name: str):  # noqa: N807  (a module's __getattr__: PEP 562)
            if name not in imported:
                raise AttributeError(f"module {_ROOT!r} has no attribute {name!r}")
            module, attribute = imported[name]
            value = getattr(importlib.import_module(module), attribute)
            setattr(root, name, value)
            return value

        def __dir__() -> list[str]:  # noqa: N807
            return sorted({*root.__dict__, *imported})

        root.__getattr__, root.__dir__ = __getattr__, __dir__
        sys.modules[_ROOT] = root


def names_of(init: Path) -> tuple[dict[str, tuple[str, str]], dict[str, object]] | None:
    """What a package's ``__init__`` defines: {name: (module, attribute)} for each ``from hivemind.x import y``,
    and its constants ({'__version__': '1.1.12'}); None if it does anything else (or cannot be read)."""
    try:
        tree = ast.parse(init.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    imported: dict[str, tuple[str, str]] = {}
    constants: dict[str, object] = {}
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            constants["__doc__"] = node.value.value
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(f"{_ROOT}."):
            if any(alias.name == "*" for alias in node.names):
                return None
            imported.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and isinstance(node.value, ast.Constant)):  # fmt: skip
            constants[node.targets[0].id] = node.value.value
        else:
            return None
    return imported, constants


def is_light() -> bool:
    """Whether this process's ``hivemind`` root is the lazy one (`install`)."""
    root = sys.modules.get(_ROOT)
    return isinstance(root, ModuleType) and "__getattr__" in root.__dict__
