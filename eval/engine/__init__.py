"""The exact engine: the verifier's forward (ours, batch-invariant, and Hugging Face's), the tree, the acceptance rules
and the one decode loop behind the drafter protocol. Knows no drafter family."""
