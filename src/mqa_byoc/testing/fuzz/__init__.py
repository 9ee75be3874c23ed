"""Property-based fuzzing of the attention partition (and, in :mod:`.gemm`, of the GEMM offload).

- :mod:`.gen`: random attention graph specs (``GraphSpec``), driven by a plain ``random.Random``
  (``tools/fuzz.py``) or by hypothesis (``tests/test_graph_fuzz.py``) through one chooser interface;
- :mod:`.build`: a spec as a Relax ``IRModule``, its inputs, and a NumPy reference of every site;
- :mod:`.oracle`: what the partition should decide for each site (the generator's ground truth);
- :mod:`.invariants`: the checks run on one graph, returning ``Violation`` records;
- :mod:`.runner`: many graphs, shrinking of failing ones, the summary;
- :mod:`.gemm`: random matmul graphs, their checks (a model of the cuBLASLt call against the graph) and run.
"""
