"""The frozen verifier M_q and its loaders (conf/verifier/ names them as Hydra targets)."""
