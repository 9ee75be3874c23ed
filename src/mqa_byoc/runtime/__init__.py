"""Run time: kernel providers, decoder runs, profiling. Importable with a runtime-only TVM."""
