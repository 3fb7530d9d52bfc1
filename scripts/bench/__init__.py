"""Benchmarks: ratios measured side by side in one process: `python -m scripts.bench.<name>`."""
