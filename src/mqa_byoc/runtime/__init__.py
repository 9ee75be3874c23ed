"""Run time: kernel providers and the native kernel cache. Importable with a runtime-only TVM."""
