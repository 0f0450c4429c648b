"""Triton kernels, each beside a plain-torch reference (`<op>_ref`).

Installed under the import name `rollout_kernels` (pyproject maps this
folder to it): PyPI's popular `kernels` package owns the name `kernels`, and
transformers (5.25 and later depend on it) imports it.
"""

if __name__ == "kernels":
    # Found as `kernels` because the repository root is on sys.path (`python -m ...` run from the
    # checkout puts the working directory first), shadowing PyPI's package: load that one in our place.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None:
        # PyPI's package is absent. Raising here breaks transformers: its availability probe imports
        # `kernels` uncaught once find_spec has found this folder. Become what it reads as "not
        # installed": a namespace package shadowing on sys.path (no __file__, no __version__, no submodules).
        __file__ = None
        __path__ = []
    else:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds after this file
        _spec.loader.exec_module(_module)
