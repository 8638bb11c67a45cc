from pathlib import Path

from gems_coverage import optable

ROOT = Path(__file__).resolve().parents[2]


def test_op_table_is_current():
    committed = (ROOT / "docs" / "ops.md").read_text()
    assert committed == optable.render(), "docs/ops.md is stale: run `python -m gems_coverage.optable > docs/ops.md`"
