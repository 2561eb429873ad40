"""benchmarks/accuracy/: see benchmarks/README.md."""
