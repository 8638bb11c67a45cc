"""Generated Python source (call signatures, plans, launch keys, pointwise wrappers), compiled under a
readable file name so that tracebacks and debuggers show the code that ran."""
from __future__ import annotations

import linecache


def compile_source(src, filename, ns):
    """exec generated source under a readable file name that tracebacks can show (linecache)."""
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    exec(compile(src, filename, "exec"), ns)  # noqa: S102 - generated from a schema and a recording
    return ns


def forget_source(filename):
    """Drop source that `compile_source` put in linecache under `filename` (its code is gone: a plan
    evicted from its bounded cache), so that linecache stays as bounded as the code it describes."""
    linecache.cache.pop(filename, None)
