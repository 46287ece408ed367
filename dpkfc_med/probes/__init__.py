"""Synthetic probe inputs and targets (pink/white noise images, Zipf token sequences): no private data, no privacy cost."""
