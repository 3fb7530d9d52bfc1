"""Exports as files: the registry-driven I/O over the per-family layouts of models/formats/."""
