"""fusedamp's benchmarks: one module per op family (python -m benchmarks.bench_<name>)."""
