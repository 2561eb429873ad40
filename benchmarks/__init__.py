"""The benchmarks, one subpackage a purpose; run each as a module from the repository root
(``python -m benchmarks.gpu.allocator_replay``). benchmarks/README.md names them all."""
