"""benchmarks/gpu/: see benchmarks/README.md."""
