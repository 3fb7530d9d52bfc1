"""The drafters, one module a family (each implements eval.engine.protocol's Drafter), and `build`, the one place a
drafter is built from a config or an export."""
