"""The torch range: every private torch name lives in vefsdp_optim/_torch_compat.py,
resolves on the installed torch, and no other library module uses one."""

import ast
import importlib
import inspect
import pkgutil
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from vefsdp_optim import _torch_compat as compat

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "vefsdp_optim" / "_torch_compat.py"
LIBRARY = [f for d in ("vefsdp_optim", "sharding", "comm") for f in sorted((ROOT / d).rglob("*.py"))]

# Private names of other libraries, which the scan cannot tell from torch's by name:
# attribute -> whose it is and why it stays where it is
NOT_TORCH = {
    "_exit": "os._exit (the standard library's, documented): _teardown.exit_rank",
    "_elementwise_max": "triton.language.standard's combine function for tl.reduce, inside a "
                        "@triton.jit kernel (_kernels._quant8_triton); triton's, checked by the "
                        "Triton tests on each triton a tested torch brings",
}

# Instance attributes (set in __init__, not on the class): where to look them up
_INSTANCES = {
    "torch.nn.Module": lambda: nn.Module(),
    "torch._ops.OpOverload": lambda: torch.ops.aten.add.Tensor,
}


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for k, name in enumerate(parts[i:], start=i):
            owner = ".".join(parts[:k])
            if not hasattr(obj, name) and owner in _INSTANCES:
                obj = _INSTANCES[owner]()
            if k == len(parts) - 1 and not hasattr(obj, name) and isinstance(obj, type) and any(
                    name in getattr(c, "__annotations__", {}) for c in obj.__mro__):
                return obj  # an instance attribute the class declares (FSDP1's FlatParameter)
            obj = getattr(obj, name)  # AttributeError names what is missing
        return obj
    raise ImportError(dotted)


def _release(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", v).groups())


@pytest.mark.parametrize("name", sorted(compat.PRIVATE_NAMES))
def test_private_name_resolves(name):
    _resolve(name)


@pytest.mark.parametrize("ours", sorted(compat.OVERRIDES))
def test_override_targets_resolve(ours):
    _resolve(compat.OVERRIDES[ours])


def test_installed_torch_is_in_the_checked_range():
    """Every name was checked on the releases TESTED names; a torch outside the declared
    range has names nobody checked (raise the range here and in pyproject.toml after
    checking each entry of PRIVATE_NAMES)."""
    have = _release(torch.__version__)
    lo, hi = (_release(v) for v in compat.TESTED)
    assert lo[:2] <= have[:2] <= hi[:2], (torch.__version__, compat.TESTED)
    for name, versions in compat.PRIVATE_NAMES.items():
        assert set(versions) >= set(compat.TESTED), (name, versions)


def test_declared_range_is_the_pyproject_pin():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch{compat.TORCH_RANGE}"' in pyproject, compat.TORCH_RANGE
    lo, hi = (_release(v) for v in compat.TESTED)
    m = re.fullmatch(r">=(\d+)\.(\d+),<(\d+)\.(\d+)", compat.TORCH_RANGE)
    assert m, compat.TORCH_RANGE
    a, b, c, d = map(int, m.groups())
    assert (a, b) == lo[:2] and (c, d) == (hi[0], hi[1] + 1), (compat.TORCH_RANGE, compat.TESTED)


def test_make_test_runs_both_ends_of_the_range():
    makefile = (ROOT / "Makefile").read_text()
    lo_pin = re.search(r"^TORCH_LO_PIN\s*\?=\s*torch==(\S+)", makefile, re.M)
    hi_pin = re.search(r"^TORCH_HI_PIN\s*\?=\s*torch==(\S+)", makefile, re.M)
    assert lo_pin and hi_pin, "Makefile: TORCH_LO_PIN / TORCH_HI_PIN"
    assert (lo_pin.group(1), hi_pin.group(1)) == compat.TESTED
    # the two venvs set up first (side by side where it can), then both runs
    assert re.search(r"^test:\n\t.*\$\(MAKE\) [^\n]*venv-lo venv-hi && \\\n\t.*\$\(MAKE\) [^\n]*test-lo test-hi;",
                     makefile, re.M), "make test runs both"
    assert re.search(r"^test-lo: \$\(STAMP_LO\)\n.*\n\t\$\(VENV_LO\)/bin/pytest", makefile, re.M)
    assert re.search(r"^test-hi: \$\(STAMP_HI\)\n.*\n\t\$\(VENV_HI\)/bin/pytest", makefile, re.M)
    assert set(compat.CHECKED) >= set(compat.TESTED), compat.CHECKED


# -- what differs between releases (see vefsdp_optim/_torch_compat.py: SINCE and its branches) ----------


def _has(dotted: str) -> bool:
    try:
        _resolve(dotted)
    except (ImportError, AttributeError):
        return False
    return True


@pytest.mark.parametrize("name", sorted(compat.SINCE))
def test_since_matches_the_installed_torch(name):
    """Each name of SINCE is present exactly from its release on (on either end of the range
    this checks a different side), and the range's lowest release lacks it."""
    first = _release(compat.SINCE[name])
    assert _has(name) == (_release(torch.__version__)[:2] >= first[:2]), (name, torch.__version__)
    assert _release(compat.TESTED[0]) < first <= _release(compat.TESTED[1]), (name, compat.TESTED)


@pytest.mark.parametrize("ours, new, old", [
    ("all_gather_single", "all_gather_single", "all_gather_into_tensor"),
    ("reduce_scatter_single", "reduce_scatter_single", "reduce_scatter_tensor"),
])
def test_flat_collectives_call_the_installed_torchs_name(ours, new, old, monkeypatch):
    """The new name where torch has it (the old one is deprecated there), else the old one,
    looked up at each call (so a wrapper around torch's function sees ours)."""
    import torch.distributed as dist

    expect = new if hasattr(dist, new) else old
    assert expect == (compat.ALL_GATHER_NAME if "gather" in ours else compat.REDUCE_SCATTER_NAME)
    calls = []
    monkeypatch.setattr(dist, expect, lambda *a, **k: calls.append((a, k)) or "work",
                        raising=True)
    out, inp, group = torch.zeros(4), torch.ones(2), object()
    if ours == "all_gather_single":
        got = compat.all_gather_single(out, inp, group, async_op=True)
        assert calls == [((out, inp), {"group": group, "async_op": True})], calls
    else:
        got = compat.reduce_scatter_single(inp, out, dist.ReduceOp.SUM, group)
        assert calls == [((inp, out), {"op": dist.ReduceOp.SUM, "group": group,
                                       "async_op": False})], calls
    assert got == "work"


def test_data_parallel_mesh_dims_or_a_clear_error():
    import torch.distributed.fsdp as torch_fsdp

    theirs = getattr(torch_fsdp, "DataParallelMeshDims", None)
    assert compat.DataParallelMeshDims is theirs
    if theirs is not None:
        assert compat.require_data_parallel_mesh_dims("x") is theirs
        return
    with pytest.raises(NotImplementedError) as e:
        compat.require_data_parallel_mesh_dims("fully_shard(dp_mesh_dims=...)")
    msg = str(e.value)
    assert "fully_shard(dp_mesh_dims=...)" in msg and "torch 2.12.0 added" in msg, msg
    assert torch.__version__ in msg and "mesh=" in msg, msg


def test_no_module_calls_a_name_that_differs_between_releases():
    """The names SINCE lists (and the old spellings they replace) are used through
    _torch_compat only, so the branch on the installed torch is made in one place (an
    import for type hints only, under ``if TYPE_CHECKING:``, runs nothing)."""
    names = {n.rsplit(".", 1)[1] for n in compat.SINCE} | {"all_gather_into_tensor",
                                                           "reduce_scatter_tensor"}
    found = []
    for f in LIBRARY:
        if f == COMPAT:
            continue
        tree = ast.parse(f.read_text())
        hints = {id(c) for n in ast.walk(tree) if isinstance(n, ast.If)
                 and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"
                 for b in n.body for c in ast.walk(b)}
        for n in ast.walk(tree):
            if id(n) in hints:
                continue
            if isinstance(n, ast.Attribute) and n.attr in names:
                found.append(f"{f.relative_to(ROOT)}:{n.lineno}: .{n.attr}")
            elif (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch"
                  and any(a.name in names for a in n.names)):
                found.append(f"{f.relative_to(ROOT)}:{n.lineno}: from {n.module} import")
    assert found == [], found


# -- the source scan ----------------------------------------------------------------------


def _defined_names(trees: list[ast.AST]) -> set[str]:
    """Names the library itself defines: functions, classes, assignment targets
    (attributes included), arguments, keywords, import aliases, __slots__ entries."""
    out: set[str] = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)):
                out.add(n.attr)
            elif isinstance(n, ast.arg):
                out.add(n.arg)
            elif isinstance(n, ast.keyword) and n.arg:
                out.add(n.arg)
            elif isinstance(n, ast.alias):
                out.add(n.asname or n.name.split(".")[0])
            elif isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
                    isinstance(t, ast.Name) and t.id == "__slots__"
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])):
                out.update(c.value for c in ast.walk(n.value) if isinstance(c, ast.Constant)
                           and isinstance(c.value, str))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# the private attributes PRIVATE_NAMES lists, e.g. _parameters of torch.nn.Module._parameters
KNOWN = {p for name in compat.PRIVATE_NAMES for p in name.split(".")[1:] if _private(p)}


def private_torch_uses(sources: dict[str, str]) -> list[str]:
    """Uses of private torch names in ``sources`` (label -> code), as 'label:line: what'.

    1. an import of a torch module with a private part, or of a private name from torch;
    2. ``x._name`` where the library defines no ``_name`` (so it is another library's),
       unless NOT_TORCH explains it; ``getattr(x, "_name")`` alike;
    3. ``x._name`` where ``_name`` is one of PRIVATE_NAMES' attributes and ``x`` is not
       ``self`` / ``cls``, even if the library defines a ``_name`` of its own.
    Not seen: a private torch attribute, not yet in PRIVATE_NAMES, that the library also
    defines, read on a torch object; test_no_class_shadows_a_private_torch_attribute covers
    classes derived from torch's.
    """
    trees = {label: ast.parse(src) for label, src in sources.items()}
    defined = _defined_names(list(trees.values()))
    found = []
    for label, tree in trees.items():
        for n in ast.walk(tree):
            what = None
            if isinstance(n, ast.Import):
                what = next((a.name for a in n.names if a.name.split(".")[0] == "torch"
                             and any(_private(p) for p in a.name.split("."))), None)
            elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "torch":
                parts = n.module.split(".")
                bad = [a.name for a in n.names if _private(a.name)]
                if any(_private(p) for p in parts) or bad:
                    what = f"from {n.module} import {', '.join(bad) or n.names[0].name}"
            elif isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in NOT_TORCH:
                if n.attr not in defined or (n.attr in KNOWN and not (
                        isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))):
                    what = f".{n.attr}"
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("getattr", "hasattr", "setattr") and len(n.args) > 1
                  and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
                  and _private(n.args[1].value) and n.args[1].value not in defined):
                what = f"{n.func.id}(..., {n.args[1].value!r})"
            if what is not None:
                found.append(f"{label}:{n.lineno}: {what}")
    return found


def test_scan_finds_private_torch_names():
    """The scan fails on what it must refuse (and passes the library's own privates)."""
    src = (
        "import torch\n"
        "import torch.utils._pytree as pt\n"
        "from torch.utils._pytree import tree_map\n"
        "from torch.distributed.checkpoint.filesystem import _StorageInfo\n"
        "from torch.distributed.tensor import DTensor\n"
        "class A:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def f(self, dt, mesh):\n"
        "        self._mine += 1\n"
        "        x = getattr(dt, '_spec')\n"
        "        return dt._local_tensor, mesh._flatten(), torch._C._foo\n"
        "    def g(self, m):\n"
        "        self._parameters = {}\n"  # defining it hides nothing: m's is torch's
        "        return m._parameters, self._parameters\n"
    )
    found = sorted(f.split(": ", 1)[1] for f in private_torch_uses({"m": src}))
    assert found == sorted([
        "torch.utils._pytree", "from torch.utils._pytree import tree_map",
        "from torch.distributed.checkpoint.filesystem import _StorageInfo",
        "getattr(..., '_spec')", "._local_tensor", "._flatten", "._foo", "._C", "._parameters",
    ]), found


def test_no_private_torch_name_outside_torch_compat():
    sources = {str(f.relative_to(ROOT)): f.read_text() for f in LIBRARY if f != COMPAT}
    assert private_torch_uses(sources) == []


def test_torch_compat_is_where_private_names_are():
    """The scan sees each entry of PRIVATE_NAMES in _torch_compat itself (so an entry is
    not stale and the scan would see it moved elsewhere)."""
    found = private_torch_uses({"compat": COMPAT.read_text()})
    text = "\n".join(found)
    for name in compat.PRIVATE_NAMES:
        last = next(p for p in reversed(name.split(".")) if _private(p))
        assert last in text, (name, found)


def _class_body_names(cls: type) -> set[str]:
    """Names the class statement itself defines (not those a metaclass adds, such as
    ABCMeta's _abc_impl or autograd.Function's _backward_cls)."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    out = set()
    for n in node.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


def test_no_class_shadows_a_private_torch_attribute():
    """A library class derived from a torch class defines a private name of its torch
    bases only where OVERRIDES declares it (torch reads or calls it)."""
    import vefsdp_optim
    import vefsdp_optim.comm
    import vefsdp_optim.sharding

    shadows = set()
    for pkg in (vefsdp_optim, vefsdp_optim.comm, vefsdp_optim.sharding):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not info.name.endswith(".__main__"):
                importlib.import_module(info.name)
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("vefsdp_optim"):
            continue
        for cls in vars(mod).values():
            if not inspect.isclass(cls) or cls.__module__ != modname:
                continue
            torch_bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] == "torch"]
            if not torch_bases:
                continue
            for name in _class_body_names(cls):
                if _private(name) and any(name in vars(b) for b in torch_bases):
                    shadows.add(f"{cls.__name__}.{name}")
    assert shadows == set(compat.OVERRIDES), shadows ^ set(compat.OVERRIDES)
