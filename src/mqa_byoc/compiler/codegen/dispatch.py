"""The ``flash_attn`` BYOC codegen: ``relax.ext.flash_attn``.

Importing this module registers ``relax.ext.flash_attn``, which ``relax.transform.RunCodegen()``
calls with every function that carries ``Codegen = "flash_attn"`` (see docs/design.md, "The
composite contract"). For each such function it reads the site (:mod:`.sites`, :mod:`.varlen`),
asks :mod:`mqa_byoc.compiler.provider` which provider serves it, and emits C++ that exports a
function named by the function's ``global_symbol`` taking ``(inputs..., out)`` (destination
passing, the inputs in the order of the function's parameters):

- ``"native"``: :func:`mqa_byoc.compiler.codegen.native.emit_native_source` (FA2 launched from C++,
  linked by ``mqa_byoc.export_library``);
- ``"hopper"``: the native wrapper with FA4's sm90 kernel for prefill
  (:mod:`mqa_byoc.compiler.codegen.hopper`), FA2 for the rest; sm_90 only;
- ``"python"``: :func:`mqa_byoc.compiler.codegen.python.emit_python_forwarder` (a call into the
  run-time registry; all python functions share one module).

The codegen options: ``provider`` (see :mod:`mqa_byoc.compiler.provider` for the rule) and
``target`` (what the default rule looks at).
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import relax

from mqa_byoc.contract import CODEGEN, LINKED_PROVIDERS

from mqa_byoc.compiler.codegen import sinks as sink_codegen
from mqa_byoc.compiler.codegen import varlen as varlen_codegen
from mqa_byoc.compiler.codegen.python import PY_PRELUDE, emit_python_forwarder
from mqa_byoc.compiler.codegen.sites import CodegenError, CodegenSite, find_site, read_spec
from mqa_byoc.compiler.graph.exprs import get_attr
from mqa_byoc.compiler.graph.spec import AttentionSpec
from mqa_byoc.compiler.provider import resolve_provider

__all__ = ["flash_attn_codegen", "spec_of"]

logger = logging.getLogger(__name__)


def spec_of(func: relax.Function) -> AttentionSpec:
    """The :class:`AttentionSpec` of a ``Codegen`` function or of a composite; errors name the site.

    Returns
    -------
    AttentionSpec
        ``find_site(func).spec`` for a ``Codegen`` function (the var-len reader's for a var-len
        one); read off ``func`` for a composite.
    """
    if get_attr(func.attrs, "Codegen") is not None:
        if varlen_codegen.is_var_len(func):
            return varlen_codegen.find_var_len_site(func).spec
        return find_site(func).spec
    return read_spec(func, str(get_attr(func.attrs, "global_symbol") or "composite"))[0]


# --------------------------------------------------------------------------- native provider


def _native_module(site: CodegenSite, hopper: bool = False):
    try:
        from mqa_byoc.compiler.codegen import native as native_codegen
    except ImportError as err:
        raise CodegenError(
            f"flash_attn codegen ({site.symbol}): provider 'native' needs mqa_byoc.compiler.codegen.native, "
            f"which failed to import ({err}). Select the python provider instead: "
            "partition_for_cutlass(..., provider='python') or "
            "RunCodegen({'flash_attn': {'provider': 'python'}})"
        ) from err
    # The source carries a marker line naming its FA2 kernel families (NativeSource.kernels);
    # mqa_byoc.export_library reads it from the C source module and links those kernels.
    source = native_codegen.emit_native_source(site.symbol, site.spec, arg_map=site.arg_map, num_inputs=site.num_inputs,
                                                shape_params=site.shape_params, hopper=hopper)
    return _csource_module(source.code, [site.symbol])


# --------------------------------------------------------------------------- the codegen


def _csource_module(code: str, symbols: list[str]):
    return tvm.get_global_func("runtime.CSourceModuleCreate")(code, "cc", symbols, [])


def flash_attn_codegen(funcs, options=None, constant_names=None) -> list:
    """``relax.ext.flash_attn``: one runtime module per native function, one for all python ones."""
    python_parts: list[str] = []
    python_symbols: list[str] = []
    modules = []
    for func in funcs:
        if varlen_codegen.is_var_len(func):
            vl = varlen_codegen.find_var_len_site(func)
            provider = resolve_provider(func, options)
            if provider in LINKED_PROVIDERS:  # hopper: FA4's var-len forward where it has an object
                modules.append(_csource_module(varlen_codegen.emit_native_source(vl, hopper=provider == "hopper").code,
                                               [vl.symbol]))
            else:
                python_parts.append(varlen_codegen.emit_python_forwarder(vl))
                python_symbols.append(vl.symbol)
            continue
        site = find_site(func)
        spec = site.spec
        provider = resolve_provider(func, options)
        logger.debug("flash_attn codegen: %s -> %s provider (%s)", site.symbol, provider, spec)
        if provider in LINKED_PROVIDERS:
            modules.append(_native_module(site, hopper=provider == "hopper"))
        elif spec.sinks_dtype is not None or spec.softcap:
            python_parts.append(sink_codegen.emit_python_forwarder(site.symbol, spec, site.arg_map, site.num_inputs,
                                                                   site.shape_params))
            python_symbols.append(site.symbol)
        else:
            python_parts.append(
                emit_python_forwarder(site.symbol, spec, site.arg_map, site.num_inputs, prelude=False,
                                      shape_params=site.shape_params)
            )
            python_symbols.append(site.symbol)
    if python_parts:
        modules.append(_csource_module(PY_PRELUDE + "".join(python_parts), python_symbols))
    return modules


tvm_ffi.register_global_func("relax.ext." + CODEGEN, flash_attn_codegen, override=True)
