"""Export formats: each family's layout, the speculators and reference formats, and the export files."""
