"""The package's shape, checked by reading its source with `ast` (nothing is imported or run).

- No module uses another module's private names: `from .x import _y`, `import gems.x._y`, or `m._y` where
  `m` names another gems module. A helper two modules need is public and lives in one place, so a reader
  can trust that an underscore name is used only in the file that defines it. Dunder names are fine, and
  so is an underscore alias of a public module (`from ..runtime import plan as _plan`): only what is read
  through it counts.
- No module is over MAX_LINES lines, except the single cohesive kernel files listed in SINGLE_KERNEL.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "gems"

# Private names still used across modules in the core (gems/dispatch.py, gems/runtime/): being made
# public there. These lists are to be emptied, never extended (an entry whose use is gone is harmless:
# delete it when you see it).
PENDING_CORE = set()
# The same for the fused ops and the model patching (gems/fused/, gems/patching/).
PENDING_FUSED = set()

MAX_LINES = 600
# One kernel family each (the kernels, their helpers and launch code, nothing else): splitting would only
# scatter one algorithm over several files.
SINGLE_KERNEL = {
    "gems/ops/attention/kernels.py",     # the flash-attention forward, split-KV combine and backward kernels
}
# Over MAX_LINES and not one kernel: to be split by job; this list is to be emptied, never extended.
PENDING_SPLIT = set()


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT)
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield path, rel.as_posix(), ".".join(parts), path.name == "__init__.py"


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(node: ast.ImportFrom, modname: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = modname.split(".")
    base = base if is_pkg else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _chain(node):
    """['m', 'a', 'b'] for the expression m.a.b, else None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + names[::-1]
    return None


def _private_uses(path: Path, modname: str, is_pkg: bool):
    """(the gems module it reaches into, the private name) for each cross-module use in one file."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    aliases = {}                            # local name -> the gems module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "gems" or a.name.startswith("gems."):
                    parts = a.name.split(".")
                    bad = [p for p in parts if _private(p)]
                    if bad:
                        found.append((a.name, bad[0]))
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases[parts[0]] = parts[0]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(node, modname, is_pkg)
            if not (src == "gems" or src.startswith("gems.")) or src == modname:
                continue
            for a in node.names:
                if _private(a.name):
                    found.append((src, a.name))
                if _is_module(f"{src}.{a.name}"):
                    aliases[a.asname or a.name] = f"{src}.{a.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = _chain(node)
        if not chain or chain[0] not in aliases:
            continue
        mod = aliases[chain[0]]
        for attr in chain[1:]:
            if _is_module(f"{mod}.{attr}") and not _private(attr):
                mod = f"{mod}.{attr}"
                continue
            if _private(attr) and mod != modname:
                found.append((mod, attr))
            break
    return found


def test_no_private_name_is_used_across_modules():
    bad = set()
    for path, rel, modname, is_pkg in _modules():
        for mod, name in _private_uses(path, modname, is_pkg):
            bad.add((rel, f"{mod}.{name}"))
    pending = PENDING_CORE | PENDING_FUSED
    new = sorted(bad - pending)
    assert not new, ("private names used from another module (make the helper public, in one place): "
                     + "; ".join(f"{rel} uses {name}" for rel, name in new))


def test_no_module_is_over_the_line_limit():
    sizes = {rel: len(path.read_text().splitlines()) for path, rel, _, _ in _modules()}
    over = {rel for rel, n in sizes.items() if n > MAX_LINES}
    new = sorted(f"{rel} ({sizes[rel]} lines)" for rel in over - SINGLE_KERNEL - PENDING_SPLIT)
    assert not new, f"modules over {MAX_LINES} lines (split them by job): {new}"
