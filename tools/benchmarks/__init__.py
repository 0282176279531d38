"""tools/bench.py's benchmarks, one module per concern over one harness."""
