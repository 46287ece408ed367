"""Training and evaluation loops, metrics and checkpoints."""
