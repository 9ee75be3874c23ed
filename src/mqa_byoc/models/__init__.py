"""Model builders used by the demo, the GPU tests and the benchmarks."""
