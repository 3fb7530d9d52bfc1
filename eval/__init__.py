"""How drafters are used: drafters, tree buffers, KV cache, acceptance rules, the decode loop, the harness."""
