"""The benchmark scripts and their helpers, one importable package.

Run a script from the repository root as a module, e.g. ``python -m benchmarks.kernels --quick``
(``bash benchmarks/run_gpu_e2e.sh`` does, on the GPU host). The tests import the helpers from here:

* :mod:`benchmarks.common` -- configurations, corpus, metrics, result files, child processes;
* :mod:`benchmarks.vllm_worker` -- one vLLM engine through greedy phases, in its own process;
* :mod:`benchmarks.greedy` -- comparing two runs' greedy outputs (near ties vs real mismatches);
* :mod:`benchmarks.compile_sm80` -- compiling every kernel specialisation for sm80.

Results go to ``benchmarks/results/``; ``benchmarks/report.py`` turns them into the README's tables.
The package is not installed with ``int8kv-shim``: it needs a checkout.
"""
