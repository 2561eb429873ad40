"""benchmarks/search/: see benchmarks/README.md."""
