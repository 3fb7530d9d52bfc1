"""What drafters learn from: prompt sources, self-distillation, chat tokenisation with loss masks, DataModules."""
