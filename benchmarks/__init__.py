"""HARTS benchmarks and tools, run from a repository checkout: ``python -m benchmarks.<name> --help``.

The standard set is ``python -m benchmarks.suite``; ``python -m benchmarks.results`` renders
``benchmarks/RESULTS.md`` from the records in ``benchmarks/results/`` and ``python -m benchmarks.docgen`` writes
docs/configuration.md. The library (``harts``) never imports this package; it is not installed with it.
"""
