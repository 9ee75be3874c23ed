"""The codegen stage: ``relax.ext.flash_attn`` turns each offloaded composite into a kernel call.

``dispatch`` (the registered codegen), ``python`` (the call into the run-time registry),
``native`` (C++ launching FA2), ``hopper`` (FA4 on sm_90), ``varlen`` (the var-len composite) and
``sinks`` (attention with sinks).
"""
