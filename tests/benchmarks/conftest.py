"""The benchmark scripts are the repository's, not an installed package: put the checkout on sys.path so that
`benchmarks` imports the same from any folder pytest runs in (without it, `tests/`, which the top conftest puts
on sys.path, makes `benchmarks` this test folder's namespace package). Appended: an installed package of the
same name would still win, as with every other import."""
import sys
from pathlib import Path

_CHECKOUT = str(Path(__file__).resolve().parents[2])
if _CHECKOUT not in sys.path:
    sys.path.append(_CHECKOUT)
