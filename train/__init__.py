"""How drafters learn: LightningModules, callbacks, export to the on-disk formats."""
