"""Triton kernels, each beside a plain-torch reference (`<op>_ref`).

Installed under the import name `rollout_kernels` (pyproject maps this
folder to it): PyPI's popular `kernels` package owns the name `kernels`, and
transformers probes it at import time.
"""
