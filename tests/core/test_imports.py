"""The package's import graph, read from its source with `ast` (nothing is imported).

- No import cycle among gems modules through module-level imports: a module's imports run when it is
  first imported, so a cycle means one of the modules is used half-initialized (or the order in which
  a user imports them decides whether it works). Importing `a.b.c` runs the packages `a.b` and `a`
  first, so an import also depends on the target's packages (except those the importer is inside of:
  they are already being imported).
- An import inside a function body (run on the first call, not at import) of a gems module says why
  it is there, in a comment on its line or the line above: a deferred import is either a way around
  a dependency the package's layering forbids, or a real need (an optional dependency, keeping
  `import gems` light), and the reader should know which.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "gems"


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        yield path, ".".join(parts), is_pkg


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _base(node: ast.ImportFrom, modname: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = modname.split(".") if is_pkg else modname.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node, modname: str, is_pkg: bool):
    """The gems modules an import statement imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "gems" or a.name.startswith("gems.")]
    base = _base(node, modname, is_pkg)
    if not (base == "gems" or base.startswith("gems.")):
        return []
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        out.append(sub if _is_module(sub) else base)
    return out


def _function_imports(tree):
    """Import statements inside function bodies."""
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield node


def _graph():
    edges, deferred = {}, []
    for path, mod, is_pkg in _modules():
        tree = ast.parse(path.read_text(), str(path))
        inner = {id(n) for n in _function_imports(tree)}
        own = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 2)} | ({mod} if is_pkg else set())
        deps = edges.setdefault(mod, set())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _targets(node, mod, is_pkg)
            if id(node) in inner:
                deferred += [(path, node.lineno, t) for t in targets]
                continue
            for t in targets:
                parts = t.split(".")
                # the target and the packages it is inside of, except those the importer is inside of
                deps.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                            if p not in own and p != mod)
    return edges, deferred


def _cycles(edges):
    """Each strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    edges, _ = _graph()
    assert not _cycles(edges), f"module-level import cycles among gems modules: {_cycles(edges)}"


def test_deferred_imports_say_why():
    _, deferred = _graph()
    bare = []
    for path, line, target in deferred:
        lines = path.read_text().splitlines()
        here, above = lines[line - 1], lines[line - 2] if line > 1 else ""
        if "#" not in here and not above.strip().startswith("#"):
            bare.append(f"{path.relative_to(ROOT)}:{line} ({target})")
    assert not bare, f"imports inside a function without a comment saying why: {bare}"


def test_the_checker_sees_a_cycle():
    # the checker itself: a two-module cycle, a cycle through a package's __init__, and no false one
    # for a package importing its own submodules
    assert _cycles({"gems.a": {"gems.b"}, "gems.b": {"gems.a"}}) == [["gems.a", "gems.b"]]
    assert _cycles({"gems.p": {"gems.p.x"}, "gems.p.x": set()}) == []
    assert _cycles({"gems.m": {"gems.p"}, "gems.p": {"gems.p.y"}, "gems.p.y": {"gems.m"}}) == \
        [["gems.m", "gems.p", "gems.p.y"]]


def test_import_and_enable_stay_light():
    # `import gems; gems.enable()` is on every user's start-up path: it must not pull in torch.compile's
    # machinery (torch._dynamo, sympy: seconds where Python has no cached bytecode for them) or transformers;
    # gems.decode, which defines custom operators for torch.compile, loads on first use
    import os
    import subprocess
    import sys
    code = ("import sys, gems; gems.enable(); heavy = [m for m in ('torch._dynamo', 'sympy', 'transformers') "
            "if m in sys.modules]; print(heavy); gems.decode.graphed; print('torch._dynamo' in sys.modules)")
    env = dict(os.environ)
    if env.get("GEMS_TEST_DEVICE", "cpu") == "cpu":
        env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split("\n")[:2] == ["[]", "True"], p.stdout
