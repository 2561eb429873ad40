"""benchmarks/speed/: see benchmarks/README.md."""
