"""The folder ``int8kv run`` puts first on ``PYTHONPATH``: its ``sitecustomize`` activates the shim
at the start of every Python process (see :mod:`int8kv_shim.cli`). Never imported as a package."""
