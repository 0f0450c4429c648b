"""The package's import structure: read from the source, checked for circles, drawn for newcomers.

    python scripts/import_graph.py            # print the diagram (Mermaid) of docs/imports.md
    python scripts/import_graph.py --write    # rewrite docs/imports.md

Modules are read with `ast` (nothing is imported). The diagram groups them by feature (GROUPS: a
sub-package, or a few shared leaf modules), draws an arrow from a group to each group it imports at
module level, and leaves out arrows that a longer path already implies, so it stays readable.
tests/unit/test_import_structure.py checks that neither the modules nor the groups form a circle,
and that docs/imports.md is this script's output.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"rollout_cli": REPO / "rollout_cli", "rollout_kernels": REPO / "kernels"}


def project_modules() -> dict[str, Path]:
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


def import_graph():
    """(module -> modules its top-level imports name, [(module, line, statement text, reason?, modules
    named)] of the imports inside functions)."""
    modules = project_modules()
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


def circles(edges) -> list[list[str]]:
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


def reaches(edges, start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        if v not in seen:
            seen.add(v)
            todo.extend(edges.get(v, ()))
    return False


# (group, its modules): a module belongs to the first group whose prefix it has (a prefix ending in
# "." is a package; one without names a module). The base and the engine's types are leaf modules
# that every layer shares; they would tie the layers into circles if they stayed in their packages.
GROUPS = [
    ("base", ("rollout_cli.errors", "rollout_cli.config", "rollout_cli.data_parallel")),
    ("engine types", ("rollout_cli.engine.sampling_params", "rollout_cli.engine.trajectory",
                      "rollout_cli.engine.multimodal", "rollout_cli.engine.tokenizer")),
    ("kernels", ("rollout_kernels",)),
    ("models", ("rollout_cli.models",)),
    ("engine/scheduling", ("rollout_cli.engine.scheduling",)),
    ("engine/execution", ("rollout_cli.engine.execution",)),
    ("engine/weights", ("rollout_cli.engine.weights",)),
    ("engine/memory", ("rollout_cli.engine.memory",)),
    ("engine", ("rollout_cli.engine",)),
    ("io", ("rollout_cli.io",)),
    ("server", ("rollout_cli.server",)),
    ("cli", ("rollout_cli.cli",)),
    ("jobs", ("rollout_cli",)),  # the top-level modules: run, score, bench, episodes, training jobs
]
DIAGRAM = REPO / "docs" / "imports.md"


def group_of(module: str) -> str:
    for name, prefixes in GROUPS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    raise ValueError(f"{module} is in no group of GROUPS")


def group_graph(edges) -> dict[str, set[str]]:
    """group -> the other groups its modules import at module level."""
    grouped = {name: set() for name, _ in GROUPS}
    for module, targets in edges.items():
        for target in targets:
            if group_of(module) != group_of(target):
                grouped[group_of(module)].add(group_of(target))
    return grouped


def without_implied(graph) -> dict[str, set[str]]:
    """The transitive reduction of an acyclic graph: a -> c is dropped where a -> b -> ... -> c exists."""
    return {a: {c for c in targets if not any(reaches(graph, b, c) for b in targets - {c})}
            for a, targets in graph.items()}


def diagram() -> str:
    edges, _ = import_graph()
    graph = group_graph(edges)
    assert not circles(graph), f"the groups form a circle: {circles(graph)}"
    shown = without_implied(graph)
    node = {name: f"g{i}" for i, (name, _) in enumerate(GROUPS)}
    lines = ["# Import structure", "",
             "Generated by `python scripts/import_graph.py --write` from the source (module-level imports);",
             "tests/unit/test_import_structure.py fails when it is out of date or when the modules or these",
             "groups form a circle. An arrow means \"imports\"; an arrow that a longer path implies is left",
             "out. `base` is errors.py, config.py and data_parallel.py; `engine types` the engine's plain",
             "types (sampling_params, trajectory, multimodal, tokenizer); `jobs` the top-level modules of",
             "rollout_cli/ (job, score_job, bench, episodes, training, ...).", "",
             "```mermaid", "flowchart TD"]
    lines += [f"    {node[name]}[\"{name}\"]" for name, _ in GROUPS]
    lines += [f"    {node[a]} --> {node[b]}" for a, _ in GROUPS for b in sorted(shown[a], key=list(node).index)]
    return "\n".join(lines + ["```", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description="Draw the package's import structure (docs/imports.md).")
    parser.add_argument("--write", action="store_true", help=f"rewrite {DIAGRAM.relative_to(REPO)}")
    args = parser.parse_args()
    text = diagram()
    if args.write:
        DIAGRAM.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
