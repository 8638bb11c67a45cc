"""Render the op table (docs/ops.md) from the registry: `python -m gems_coverage.optable > docs/ops.md`.

The table is generated, never edited by hand, so it cannot drift from what Gems registers; a test
checks the committed file is current.
"""
import sys

import torch

from gems import registry

_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
          torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
          torch.bool: "bool"}


def render() -> str:
    impls = registry.all_impls()
    lines = ["# Op table", "",
             "Generated from the registry by `python -m gems_coverage.optable > docs/ops.md`; do not edit by hand.", "",
             f"{len(impls)} ATen overloads, {len({i.base for i in impls})} ops. "
             "`dtypes`: what Gems serves for the first tensor argument; other inputs run ATen's kernel "
             "and are counted in `gems.stats()`. A *group*'s name selects all its overloads: "
             "`gems.enable(exclude=(\"attention\",))`.", "",
             "| overload | category | dtypes | kind | backends | note |",
             "| --- | --- | --- | --- | --- | --- |"]
    for i in impls:
        dts = ", ".join(_SHORT.get(d, str(d).replace("torch.", "")) for d in i.dtypes)
        kind = "backward" if i.backward else "forward"
        note = (f"group `{i.group}`: " if i.group else "") + i.doc
        lines.append(f"| `{i.name}` | {i.category} | {dts} | {kind} | {', '.join(i.backends)} | {note} |")
    return "\n".join(lines) + "\n"


def main():
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
