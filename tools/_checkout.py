"""Import ``vefsdp_optim`` from this checkout, uninstalled: ``make gpu-check`` runs on a
machine's own python (no network there, nothing installed into it).

[Note: checkout imports]
pyproject.toml maps two top-level folders into the package (``package-dir``:
``vefsdp_optim.comm`` is ``comm/``, ``vefsdp_optim.sharding`` is ``sharding/``), so the
checkout on ``PYTHONPATH`` alone gives ``vefsdp_optim`` without them. Importing this
module puts a finder first on ``sys.meta_path`` that resolves exactly the names of that
mapping to the checkout's folders; every other name (the modules inside each package)
is found through the package's ``__path__`` as usual. An installed copy of the library
elsewhere is then shadowed, never mixed in. It must be imported before anything imports
``vefsdp_optim``: the check's own modules import it first, pytest loads it with
``-p tools._checkout``, and spawned ranks re-import the module that defines their
function, which imports it again. Standard library only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "install", "package_dirs"]


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """pyproject.toml's ``[tool.setuptools] package-dir``: package name -> folder."""
    text = (root / "pyproject.toml").read_text()
    try:
        import tomllib

        mapping = tomllib.loads(text)["tool"]["setuptools"]["package-dir"]
    except ModuleNotFoundError:  # python 3.10: the one line, read as text
        m = re.search(r"^package-dir\s*=\s*\{(.*)\}\s*$", text, re.M)
        if m is None:
            raise ValueError(f"{root / 'pyproject.toml'}: no [tool.setuptools] package-dir line") from None
        mapping = dict(re.findall(r'"([\w.]+)"\s*=\s*"([\w./-]+)"', m.group(1)))
    return {name: root / folder for name, folder in mapping.items()}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the packages of ``package-dir`` in the checkout ([Note: checkout imports])."""

    vefsdp_checkout = True  # marks an installed finder, also across reloads of this module

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        folder = self.dirs.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def install() -> None:
    """Put the checkout's finder first on ``sys.meta_path`` (once per process)."""
    if any(getattr(f, "vefsdp_checkout", False) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _CheckoutFinder(package_dirs()))
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


install()
