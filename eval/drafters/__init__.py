"""The drafters, one module a family (each implements eval.engine.forward.protocol), and `build`, the one place a
drafter is built from a config or an export."""
