"""Python runs this at start-up in every process of a ``serve_bench.py --step-timing`` server
(this folder leads its PYTHONPATH): :mod:`benchmarks.step_timing` times the engine's steps. Then
the next ``sitecustomize`` on the path, which this one shadows, runs as it would have."""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

try:
    from benchmarks import step_timing

    step_timing.install_from_env()
except Exception as e:  # a diagnostic must never stop the server it measures
    print(f"serve_bench step timing: not installed: {e!r}", file=sys.stderr)

for _entry in sys.path:
    _candidate = os.path.join(os.path.abspath(_entry or "."), "sitecustomize.py")
    if os.path.dirname(_candidate) != _HERE and os.path.isfile(_candidate):
        _spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", _candidate)
        if _spec is not None and _spec.loader is not None:
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
