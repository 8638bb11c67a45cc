"""Copy this machine's autotuning picks into the table Gems ships (gems/runtime/tuned/<arch>/), so that
a first call on this GPU architecture finds them instead of tuning.

    gems-coverage tune MODEL --device cuda --seq-len N ...   # tune the buckets a model meets (per model)
    python scripts/ship_tuned.py                             # merge the cache's picks into the shipped table

Only the default timing's files are shipped (GEMS_TUNE_TIMING changes which file a tuner reads); picks
already shipped for a bucket are replaced by this machine's. Run on the GPU the table is for.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", help="the architecture folder to ship (default: this machine's backend)")
    ap.add_argument("--cache", help="the Gems cache dir (default: $GEMS_CACHE_DIR or ~/.cache/gems)")
    a = ap.parse_args(argv)
    from gems.runtime import autotune, backends
    arch = a.arch or backends.backend().arch
    src = (Path(a.cache) if a.cache else autotune.cache_dir()) / "autotune" / arch
    dst = autotune.SHIPPED_DIR / arch
    suffix = "" if autotune.TIMING == "do_bench" else f"-{autotune.TIMING}"
    files = sorted(p for p in src.glob(f"*{suffix}.json")) if src.is_dir() else []
    if not files:
        print(f"no tuned picks in {src}: run gems-coverage tune on this GPU first", file=sys.stderr)
        return 1
    dst.mkdir(parents=True, exist_ok=True)
    for f in files:
        picks = json.loads(f.read_text())
        out = dst / f.name
        merged = {**(json.loads(out.read_text()) if out.exists() else {}), **picks}
        out.write_text(json.dumps(merged, indent=0, sort_keys=True) + "\n")
        print(f"{out}: {len(merged)} buckets ({len(picks)} from this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
