"""gems-coverage: which ATen ops a model calls, which Gems covers, what is missing, and parity with Gems on.

Modules: ``cli`` (the commands; ``parser`` holds their options, ``arguments`` the argument types and the
errors that become exit codes), ``classify`` (op categories), ``gemsinfo`` (the Gems registry, read lazily),
``tracer`` (dispatch-mode trace + profiler), ``runner`` (run a model in inference/generate/training), ``report``
(table/JSON/markdown/CSV and the op x model matrix), ``roadmap`` and ``plot`` (coverage history, pictures),
``parity`` (Gems vs ATen), ``bench`` and ``bench_result`` (a workload with ATen and with Gems, per-op
attribution), ``tune`` (GEMM tuning ahead of a run), ``distributed`` (DDP/FSDP2 training under torchrun),
``optable`` (docs/ops.md from the registry). The models themselves come from the ``gems_models`` package.
"""

SCHEMA_VERSION = 1
