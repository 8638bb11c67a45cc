"""gems-coverage: which ATen ops a model calls, which Gems covers, what is missing, and parity with Gems on.

Modules: ``classify`` (op categories), ``gemsinfo`` (the Gems registry, read lazily), ``tracer`` (dispatch-mode
trace + profiler), ``runner`` (run a model in inference/generate/training), ``report`` (table/JSON/markdown/CSV
and the op x model matrix), ``roadmap`` (coverage history + PNG), ``parity`` (Gems vs ATen), ``cli``.
"""

SCHEMA_VERSION = 1
