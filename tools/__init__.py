"""Benchmarks and measurement tools, run as modules: ``python -m tools.bench``, ``python -m tools.scale``."""
