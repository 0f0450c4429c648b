"""The import structure stays readable (issue 24): the package's module-level imports form no circle,
an import inside a function is there for a heavy or optional dependency and says so, and the command
line starts without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"rollout_cli": REPO / "rollout_cli", "rollout_kernels": REPO / "kernels"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _imported(module: str, path: Path, node, modules) -> list[str]:
    """Project modules an import statement names (a `from X import y` of a submodule y names X.y)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    base = module.split(".")
    if node.level:
        base = base[:len(base) - node.level + (path.name == "__init__.py")]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
            for a in node.names if target in modules or f"{target}.{a.name}" in modules]


def _type_checking_nodes(tree) -> set:
    nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes |= set(ast.walk(node))
    return nodes


def _import_graph():
    """(module -> modules its top-level imports name, [(module, line, statement text, reason?, modules
    named)] of the imports inside functions)."""
    modules = _modules()
    edges, local = {m: set() for m in modules}, []
    for module, path in modules.items():
        source = path.read_text()
        lines, tree = source.splitlines(), ast.parse(source)
        skipped = _type_checking_nodes(tree)
        in_functions = {n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or node in skipped:
                continue
            targets = _imported(module, path, node, modules)
            if not targets:
                continue
            if node not in in_functions:  # module level, a try/except ImportError block included
                edges[module].update(targets)
                continue
            # the reason: a comment on the statement's last line, or in the block of imports (and
            # blank lines) right above it
            above, i = [], node.lineno - 2
            while i >= 0 and (not lines[i].strip() or lines[i].strip().startswith(("#", "from ", "import "))):
                above.append(lines[i])
                i -= 1
            reason = "#" in lines[node.end_lineno - 1] or any("#" in line for line in above)
            local.append((module, node.lineno, lines[node.lineno - 1].strip(), reason, targets))
    return edges, local


def _circles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _reaches(edges, start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        if v not in seen:
            seen.add(v)
            todo.extend(edges.get(v, ()))
    return False


def test_module_level_imports_form_no_circle():
    edges, _ = _import_graph()
    assert sum(map(len, edges.values())) > 100  # the graph was read
    assert _circles(edges) == []


def test_no_import_inside_a_function_hides_a_circle_and_each_says_why():
    edges, local = _import_graph()
    assert local  # the CLI's lazy imports at least
    hiding = [(m, line, text) for m, line, text, _, targets in local if any(_reaches(edges, t, m) for t in targets)]
    assert hiding == []
    unexplained = [(m, line, text) for m, line, text, reason, _ in local if not reason]
    assert unexplained == []


def test_the_command_line_starts_without_torch():
    code = "import sys, rollout_cli.cli.main; print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_package_folder_is_installed():
    """pyproject lists packages one by one: a new sub-package left out works in the editable checkout
    and is missing from a wheel."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join((package, *init.parent.relative_to(root).parts))
               for package, root in PACKAGES.items() for init in root.rglob("__init__.py")}
    assert folders and folders <= listed, sorted(folders - listed)
