"""The top-level package is lazy (see vefsdp_optim/__init__.py):
the lower layers import alone, every public name still resolves, type checkers see the
same names, and the registry finds the built-in optimizers whatever was imported
(see ``_BUILTINS`` in vefsdp_optim/_registry.py)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vefsdp_optim
from vefsdp_optim import _registry

INIT = Path(vefsdp_optim.__file__)

# One fresh interpreter: each import adds modules, so checking after each of them
# checks every import alone too. Then the registry, still before any optimizer loads.
_SCRIPT = textwrap.dedent("""
    import importlib, sys
    import torch
    import vefsdp_optim
    above = {"vefsdp_optim" + m for m in set(vefsdp_optim._LAZY.values())}
    above |= {"vefsdp_optim._step_loop", "vefsdp_optim._step_plan", "vefsdp_optim.toy"}

    def loaded():
        return sorted(m for m in sys.modules if any(m == a or m.startswith(a + ".") for a in above))

    for name in ["vefsdp_optim", "vefsdp_optim.sharding", "vefsdp_optim.comm", "vefsdp_optim._math"]:
        importlib.import_module(name)
        print(name, loaded())

    class Mine(torch.optim.SGD):
        pass

    try:
        vefsdp_optim.register_optimizer("Shampoo", Mine)
        print("registered over a built-in")
    except ValueError as e:
        print("refused", "Shampoo" in str(e) and "overwrite=True" in str(e))
    print("muon", vefsdp_optim.get_optimizer("muon") is vefsdp_optim.Muon)
""")


def test_lower_layers_import_without_the_layers_above():
    res = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines() == [
        "vefsdp_optim []", "vefsdp_optim.sharding []", "vefsdp_optim.comm []", "vefsdp_optim._math []",
        "refused True", "muon True"], res.stdout


def test_every_public_name_resolves_to_its_module():
    assert set(vefsdp_optim.__all__) == set(vefsdp_optim._LAZY)
    for name in vefsdp_optim.__all__:
        mod = importlib.import_module(vefsdp_optim._LAZY[name], "vefsdp_optim")
        assert getattr(vefsdp_optim, name) is getattr(mod, name), name
        exec(f"from vefsdp_optim import {name}", {})  # noqa: S102
    assert set(vefsdp_optim.__all__) <= set(dir(vefsdp_optim))
    with pytest.raises(AttributeError, match="no attribute 'Adam'"):
        vefsdp_optim.Adam  # noqa: B018


def test_type_checking_block_names_the_lazy_table():
    tree = ast.parse(INIT.read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    seen = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        for alias in node.names:
            assert alias.asname is None, ast.unparse(node)
            seen[alias.name] = "." + node.module
    assert seen == vefsdp_optim._LAZY


def test_builtin_table_matches_the_decorators():
    wanted = {k: getattr(importlib.import_module(m), c) for k, (m, c) in _registry._BUILTINS.items()}
    for key, cls in wanted.items():
        assert vefsdp_optim.get_optimizer(key) is cls, key
    builtin = {k for k, c in _registry._REGISTRY.items() if c.__module__.startswith("vefsdp_optim.")}
    assert builtin == set(wanted), builtin ^ set(wanted)
    assert set(wanted) <= set(vefsdp_optim.list_optimizers())
