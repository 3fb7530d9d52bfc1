"""What every layer uses and no layer owns: user errors, W&B mode, CPU memory, process groups. Imports nothing of this
project."""
