"""The library's imports go one way: no module reaches itself through its imports, the
ones under ``TYPE_CHECKING`` and inside functions included (as FSDP2's chain of files),
so each layer can be read, and tested, without the layers above it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vefsdp_optim", "sharding", "comm")


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the library's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _canonical(name: str, modules: dict[str, Path]) -> str | None:
    """The library module ``name`` loads (its longest known prefix), or None outside the
    library. ``vefsdp_optim.sharding`` and ``vefsdp_optim.comm`` are the top-level
    ``sharding`` and ``comm``."""
    for pkg in ("sharding", "comm"):
        if name == f"vefsdp_optim.{pkg}" or name.startswith(f"vefsdp_optim.{pkg}."):
            name = name[len("vefsdp_optim."):]
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The library modules ``name`` imports anywhere in its file."""
    out = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            # ``from pkg import sub`` imports the submodule pkg.sub where there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            m = _canonical(t, modules)
            if m is not None and m != name:
                out.add(m)
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_cycle():
    edges = _graph()
    found = [[f"{m} -> {sorted(edges[m] & set(c))}" for m in c] for c in _cycles(edges)]
    assert not found, "import cycles (each module -> the modules of its cycle it imports):\n" + "\n".join(
        "\n".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    """The checker against its definition: a cycle through a TYPE_CHECKING import and an
    import inside a function is found, a chain is not."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    modules = _modules()
    fsdp = ROOT / "vefsdp_optim" / "_fsdp" / "_module.py"
    assert "vefsdp_optim._fsdp._state" in _imports("vefsdp_optim._fsdp._module", fsdp, modules)
    # a TYPE_CHECKING import counts (sharded tensor -> flat store, for a type only)
    sharded = ROOT / "vefsdp_optim" / "_fsdp" / "_sharded_tensor.py"
    assert "vefsdp_optim._flat_store" in _imports("vefsdp_optim._fsdp._sharded_tensor", sharded, modules)
    # an import inside a function counts (the checkpoint format -> fully_shard's package)
    fmt = ROOT / "vefsdp_optim" / "_checkpoint" / "_format.py"
    assert "vefsdp_optim._fsdp" in _imports("vefsdp_optim._checkpoint._format", fmt, modules)


def test_the_checkpoint_format_imports_no_optimizer():
    """The checkpoint package reads optimizers through CheckpointedOptimizer only."""
    edges = _graph()
    for name in (m for m in edges if m.startswith("vefsdp_optim._checkpoint")):
        assert not {m for m in edges[name] if m in ("vefsdp_optim._block_optimizer", "vefsdp_optim._step_loop",
                                                     "vefsdp_optim._step_plan")}, (name, edges[name])


def test_no_library_file_over_450_lines():
    """Each file of the library reads in one sitting (docs/design.md's layers)."""
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"library files over 450 lines (split them along a seam): {long}"
