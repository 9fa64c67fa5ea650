"""Benchmarks and checks of pt2-handlers on one harness: ``python -m benchmarks.NAME`` from the repository root."""
