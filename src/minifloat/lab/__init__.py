"""The command line: `python -m minifloat ...`."""
