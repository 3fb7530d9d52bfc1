"""A drafter family defined outside the package, as a plugin would be: tests/test_add_family.py registers it."""
