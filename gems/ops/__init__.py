"""One module per op family; importing them fills the registry.

Every module in this package is imported (modules named `utils` or starting with `_` excepted), so a
new op family is one new file and no edit here.
"""
import importlib
import pkgutil

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _m != "utils" and not _m.startswith("_"):
        importlib.import_module(f"{__name__}.{_m}")
