"""Python imports this module at start-up because ``int8kv run`` put its folder first on
``PYTHONPATH``: in the command it runs and in every Python process started from it.

Importing the shim instruments vLLM (``int8kv run`` sets ``INT8KV_SHIM=1``) and imports neither
vLLM nor torch. Only the first ``sitecustomize`` on the path is ever imported, so the one this
module shadows (a user's or the distribution's, further down the path) is run after it.
"""

import importlib.machinery
import importlib.util
import os
import sys

import int8kv_shim  # noqa: F401


def _run_the_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_run_the_shadowed_sitecustomize()
