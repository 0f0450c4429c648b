"""The import structure stays readable (issue 24): the package's module-level imports form no circle,
an import inside a function is there for a heavy or optional dependency and says so, the command
line starts without torch, and docs/imports.md (the diagram of the feature groups) is up to date.
The graph is read by scripts/import_graph.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GRAPH = _load_script()


def test_module_level_imports_form_no_circle():
    edges, _ = GRAPH.import_graph()
    assert sum(map(len, edges.values())) > 100  # the graph was read
    assert GRAPH.circles(edges) == []


def test_no_import_inside_a_function_hides_a_circle_and_each_says_why():
    edges, local = GRAPH.import_graph()
    assert local  # the CLI's lazy imports at least
    hiding = [(m, line, text) for m, line, text, _, targets in local if any(GRAPH.reaches(edges, t, m) for t in targets)]
    assert hiding == []
    unexplained = [(m, line, text) for m, line, text, reason, _ in local if not reason]
    assert unexplained == []


def test_the_command_line_starts_without_torch():
    code = "import sys, rollout_cli.cli.main; print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=GRAPH.REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_package_folder_is_installed():
    """pyproject lists packages one by one: a new sub-package left out works in the editable checkout
    and is missing from a wheel."""
    import tomllib

    listed = set(tomllib.loads((GRAPH.REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join((package, *init.parent.relative_to(root).parts))
               for package, root in GRAPH.PACKAGES.items() for init in root.rglob("__init__.py")}
    assert folders and folders <= listed, sorted(folders - listed)


def test_the_feature_groups_form_no_circle_and_the_diagram_is_current():
    edges, _ = GRAPH.import_graph()
    grouped = GRAPH.group_graph(edges)
    assert grouped["cli"] and grouped["engine"]  # the groups were read
    assert GRAPH.circles(grouped) == []
    assert GRAPH.DIAGRAM.read_text() == GRAPH.diagram(), "run python scripts/import_graph.py --write"
