"""The library's layering, read from the source with `ast` (nothing is imported):

  - no import cycle among specjax/, pallas_kernels/ and cpu_kernels/ modules (module-level imports; a package
    import implies its __init__, a submodule import its parent packages' __init__ beside it, except the importer's
    own ancestors, which are already initialising when it runs), nor once imports under TYPE_CHECKING count too;
  - the seam between the library and its backends: nothing under specjax/ imports cpu_kernels or pallas_kernels
    (they register into specjax.ops, which finds them by name: specjax.ops.backends.PLUGINS, the registration
    point); the models call specjax.ops only;
  - the ground floor: the request inputs, the batch planning and the config sit below the decode loop, the API and
    the drafters (none of them reaches specjax.decode, specjax.api or specjax.drafters, however indirectly);
  - one module names the SPECJAX_ environment variables: specjax.settings;
  - nothing under specjax/drafters/ imports specjax.api (or the specjax package, which is the API);
  - no module imports another module's private name (`from m import _x`, or `m._x` on an imported module), here
    and, separately, in train/ and experiments/;
  - no import inside a function body except of an optional heavy dependency (OPTIONAL_IMPORTS): an import moved
    into a function to dodge a cycle is a cycle.
"""
from __future__ import annotations

import ast
import os
import re
from typing import Iterator, NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ("specjax", "pallas_kernels", "cpu_kernels")
SCRIPTS = ("train", "experiments")
# What a library function may import (dotted prefixes): optional or heavy dependencies a module needs only on one
# path, so that `import specjax` works without them and does not pay for them.
OPTIONAL_IMPORTS = {
    "torch": "reading .bin / .pt checkpoints (an optional install)",
    "transformers": "converting from transformers objects (an optional install)",
    "vllm": "the vLLM comparison (a separate install)",
    "jax.experimental.pallas": "a Pallas backend's lowering (TPU / Triton): ~0.4 s to import, loaded only on the "
                               "platform whose kernel runs",
    # the kernels of one platform, which import that backend at their top
    "pallas_kernels.verify_attention.gpu": "the Triton kernel (imports jax.experimental.pallas.triton)",
    "pallas_kernels.verify_attention.tpu": "the Mosaic TPU kernel (imports jax.experimental.pallas.tpu)",
}


class Import(NamedTuple):
    module: str           # the importing module, dotted
    path: str             # its file, relative to the repository
    line: int
    targets: tuple        # the internal modules it loads, dotted (explicit ones first)
    explicit: tuple       # those named by the statement (not only implied as a parent package)
    names: tuple          # for `from m import a, b`: (a, b)
    source: str           # the module the statement names (absolute), third-party included
    in_function: bool


def module_files(packages: tuple) -> dict:
    """{dotted module name: path} of every .py file under the given top-level directories."""
    out = {}
    for top in packages:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for f in sorted(filenames):
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                    parts = rel[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    out[".".join(parts)] = rel
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(body: list, in_function: bool = False, type_checking: bool = False) -> Iterator[tuple]:
    """(node, in_function) for every import statement, skipping `if TYPE_CHECKING:` bodies unless type_checking."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body if type_checking else node.orelse, in_function, type_checking)
            if type_checking:
                yield from _import_nodes(node.orelse, in_function, type_checking)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _import_nodes(node.body if isinstance(node.body, list) else [], True, type_checking)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _import_nodes(getattr(node, field, None) or [], in_function, type_checking)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _with_parents(name: str, known: dict, importer: str) -> list:
    """name and its parent packages that are modules we know, minus the importer's own ancestors."""
    parts = name.split(".")
    out = []
    for i in range(1, len(parts) + 1):
        candidate = ".".join(parts[:i])
        if candidate in known and not (i < len(parts) and importer.startswith(candidate + ".")):
            out.append(candidate)
    return out


def imports_of(module: str, path: str, known: dict, root: str = ROOT, type_checking: bool = False) -> list:
    """Every import statement of one module, resolved against the modules we know (type_checking: those under
    `if TYPE_CHECKING:` too)."""
    with open(os.path.join(root, path)) as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    out = []
    for node, in_function in _import_nodes(tree.body, type_checking=type_checking):
        if isinstance(node, ast.Import):
            for alias in node.names:
                explicit = [alias.name] if alias.name in known else []
                targets = _with_parents(alias.name, known, module)
                out.append(Import(module, path, node.lineno, tuple(dict.fromkeys(explicit + targets)),
                                  tuple(explicit), (), alias.name, in_function))
        else:
            source = _absolute(module, is_package, node)
            explicit = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                explicit.append(sub if sub in known else source)
            explicit = [e for e in dict.fromkeys(explicit) if e in known]
            targets = [t for e in explicit for t in _with_parents(e, known, module)]
            out.append(Import(module, path, node.lineno, tuple(dict.fromkeys(explicit + targets)), tuple(explicit),
                              tuple(a.name for a in node.names), source, in_function))
    return out


def graph(imports: list) -> dict:
    """{module: {imported module: line}} over module-level imports, self edges dropped."""
    edges: dict = {}
    for imp in imports:
        if imp.in_function:
            continue
        for t in imp.targets:
            if t != imp.module:
                edges.setdefault(imp.module, {}).setdefault(t, imp.line)
    return edges


def find_cycles(edges: dict) -> list:
    """One cycle (a list of modules, first == last) per strongly connected component with more than one module."""
    index, low, on_stack, stack, sccs = {}, {}, set(), [], []

    def connect(v):                      # Tarjan's algorithm (the graph has a few hundred nodes: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(set(scc))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    cycles = []
    for scc in sccs:                     # a shortest path back to the start, inside the component
        start = min(scc)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nxt = sorted(w for w in edges.get(path[-1], {}) if w in scc)
            if start in nxt:
                cycles.append(path + [start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return cycles


def describe(cycle: list, edges: dict, files: dict) -> str:
    return " -> ".join(cycle) + "  (" + ", ".join(f"{files[a]}:{edges[a][b]}" for a, b in zip(cycle, cycle[1:])) + ")"


def private_uses(imports: list, files: dict, root: str = ROOT) -> list:
    """`from m import _x` and `m._x` (m bound by an import to a module) across modules: 'path:line: what'."""
    out = []
    by_module: dict = {}
    for imp in imports:
        by_module.setdefault(imp.module, []).append(imp)
    for module, imps in by_module.items():
        for imp in imps:
            for name in imp.names:
                if name.startswith("_") and not name.startswith("__") and f"{imp.source}.{name}" not in files:
                    out.append(f"{imp.path}:{imp.line}: from {imp.source} import {name}")
        with open(os.path.join(root, files[module])) as f:
            tree = ast.parse(f.read())
        bound = {}                        # local name -> the module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in files:
                        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                    and node.attr.startswith("_") and not node.attr.startswith("__") and bound[node.value.id] != module:
                out.append(f"{files[module]}:{node.lineno}: {node.value.id}.{node.attr} ({bound[node.value.id]})")
    return sorted(set(out))


def scan(packages: tuple, known_packages: tuple = LIBRARY, type_checking: bool = False) -> tuple:
    """-> (files of the scanned modules, every import of them) resolved against known_packages' modules too."""
    files = module_files(packages)
    known = {**module_files(known_packages), **files}
    imports = [imp for m, p in files.items() for imp in imports_of(m, p, known, type_checking=type_checking)]
    return files, known, imports


@pytest.mark.parametrize("type_checking", [False, True], ids=["runtime", "with_type_only_links"])
def test_no_import_cycle(type_checking):
    files, _, imports = scan(LIBRARY, type_checking=type_checking)
    edges = graph(imports)
    cycles = [describe(c, edges, files) for c in find_cycles(edges)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def reachable(edges: dict, start: str) -> set:
    """Every module `start` imports, however indirectly (module-level imports)."""
    seen, todo = set(), [start]
    while todo:
        for t in edges.get(todo.pop(), {}):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


BACKEND_PACKAGES = ("cpu_kernels", "pallas_kernels")


def test_the_library_imports_no_backend_package():
    """specjax (the models above all) calls specjax.ops; the backend packages register into it and are found by
    name at the one registration point, never imported."""
    from specjax.ops import backends
    _, _, imports = scan(LIBRARY, type_checking=True)
    bad = [f"{imp.path}:{imp.line}: imports {imp.source}" for imp in imports if imp.module.startswith("specjax")
           and any(imp.source == p or imp.source.startswith(p + ".") for p in BACKEND_PACKAGES)]
    assert not bad, "specjax/ imports a backend package:\n" + "\n".join(bad)
    assert backends.PLUGINS == BACKEND_PACKAGES
    named = []
    for module, path in module_files(("specjax",)).items():
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        named += [f"{path}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Constant)
                  and n.value in BACKEND_PACKAGES]
    assert sorted(set(named)) == [os.path.join("specjax", "ops", "backends.py") + f":{_plugins_line()}"], named


def _plugins_line() -> int:
    path = os.path.join(ROOT, "specjax", "ops", "backends.py")
    with open(path) as f:
        return next(i for i, line in enumerate(f, 1) if line.startswith("PLUGINS = "))


def test_the_ground_floor_sits_below_the_loop():
    files, _, imports = scan(LIBRARY, type_checking=True)
    edges = graph(imports)
    above = ("specjax.decode", "specjax.api", "specjax.drafters")
    for floor in ("specjax.inputs", "specjax.planning", "specjax.config", "specjax.settings", "specjax.ops"):
        up = sorted(m for m in reachable(edges, floor) if any(m == a or m.startswith(a + ".") for a in above))
        assert not up, f"{floor} reaches {up}"


def test_one_module_names_the_environment():
    """Every SPECJAX_ variable is spelled in specjax/settings.py alone (library, scripts and notebooks' builder)."""
    pattern = re.compile(r"SPECJAX_[A-Z0-9_]*")
    bad = []
    for module, path in {**module_files(LIBRARY), **module_files(SCRIPTS)}.items():
        if path == os.path.join("specjax", "settings.py"):
            continue
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.search(node.value):
                body = node.value.strip()
                docstring = "\n" in body or body.endswith(".")
                if not docstring:
                    bad.append(f"{path}:{node.lineno}: {node.value!r}")
    assert not bad, "SPECJAX_ variables named outside specjax.settings:\n" + "\n".join(bad)


def test_drafters_do_not_import_the_api():
    _, _, imports = scan(LIBRARY)
    bad = [f"{imp.path}:{imp.line}: imports {', '.join(t for t in imp.explicit if t in ('specjax', 'specjax.api'))}"
           for imp in imports if imp.module.startswith("specjax.drafters")
           and {"specjax", "specjax.api"} & set(imp.explicit)]
    assert not bad, "drafters reach into the user-facing API:\n" + "\n".join(bad)


def test_no_private_name_crosses_a_module():
    files, _, imports = scan(LIBRARY)
    bad = private_uses(imports, files)
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def test_scripts_use_no_private_library_name():
    """train/ and experiments/: no private name of the library or of each other."""
    files, _, imports = scan(SCRIPTS, LIBRARY + SCRIPTS)
    bad = private_uses(imports, {**module_files(LIBRARY), **files})
    bad = [b for b in bad if b.split(":")[0] in files.values()]
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def _optional(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in OPTIONAL_IMPORTS)


def test_imports_inside_functions_are_optional_dependencies():
    _, _, imports = scan(LIBRARY)
    bad = []
    for imp in imports:
        if not imp.in_function or all(_optional(t) for t in (imp.explicit or (imp.source,))):
            continue
        what = "a library module" if imp.targets else "not an optional dependency"
        bad.append(f"{imp.path}:{imp.line}: {imp.source} ({what}: import it at the top, or name it in "
                   f"OPTIONAL_IMPORTS with the reason it is optional)")
    assert not bad, "imports inside functions:\n" + "\n".join(bad)


def test_the_scanner_sees_what_it_checks(tmp_path):
    """The checks above cannot pass by seeing nothing: a planted cycle, private names (imported, and read off an
    imported module) and imports inside a function are found; one under TYPE_CHECKING is not."""
    files = {"pkg": "pkg/__init__.py", "pkg.a": "pkg/a.py", "pkg.b": "pkg/b.py"}
    sources = {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import _hidden\nfrom pkg import b\nb._other()\n",
               "pkg/b.py": "import os\n\ndef f():\n    import pkg.a\n    from pkg import a\n\n"
                           "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\nimport pkg.a\n"}
    for rel, text in sources.items():
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        (tmp_path / rel).write_text(text)
    imports = [imp for m, p in files.items() for imp in imports_of(m, p, files, str(tmp_path))]
    edges = graph(imports)
    assert find_cycles(edges) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert private_uses(imports, files, str(tmp_path)) == ["pkg/a.py:1: from pkg.b import _hidden",
                                                           "pkg/a.py:3: b._other (pkg.b)"]
    assert [(i.line, i.targets) for i in imports if i.in_function] == [(4, ("pkg.a",)), (5, ("pkg.a",))]
    assert not any(i.line == 9 for i in imports)               # under TYPE_CHECKING: skipped
