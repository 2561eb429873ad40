"""benchmarks/long_context/: see benchmarks/README.md."""
