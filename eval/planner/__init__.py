"""The planner: the verifier's cost curve and the drafter's, the budget they choose before a run (cost) and round by
round (adaptive)."""
