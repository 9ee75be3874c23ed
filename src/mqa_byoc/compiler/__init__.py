"""Compile time: canonicalization, patterns, partition, codegen. Needs the full apache-tvm wheel."""
