"""The graph stage: find each attention, decide whether a kernel computes it exactly, rewrite it into
the canonical call and the composite's pattern.

``trace`` (operands back to their sources), ``masks``, ``site`` (the site and the checks every form
shares), ``analysis`` (``R.nn.attention`` and matmul-softmax chains), ``varlen``
(``R.nn.attention_var_len``), ``sinks`` (attention sinks on the softmax side, chains nothing else
explains), ``sink_attention`` (a sink site's function and composite), ``canonicalize``,
``gqa_legalize``, ``patterns``, ``gemm`` (the GEMM pattern table and report), ``lowered_matmul`` (matmuls
TVM lowered before the partition, read back), ``spec`` (what a composite says to the codegen) and ``exprs`` (small
helpers on Relax expressions).
"""
