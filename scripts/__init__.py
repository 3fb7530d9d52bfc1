"""Thin command lines over the packages (benchmarks, plots, data building): run as `python -m scripts.<name>`."""
