"""Plain nn.Modules and their loaders: the frozen verifier, Medusa heads. No Lightning here."""
