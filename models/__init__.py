"""Plain nn.Modules: every drafter family's network (one module a family), the family registry (families.py), the
export formats (formats/) and the verifier's loaders (verifiers/). No Lightning here."""
