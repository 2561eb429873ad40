"""benchmarks/probe/: see benchmarks/README.md."""
