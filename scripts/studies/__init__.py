"""One-off studies, each reported in the docs/results/ file that links it: `python -m scripts.studies.<name>`."""
