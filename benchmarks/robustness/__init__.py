"""benchmarks/robustness/: see benchmarks/README.md."""
