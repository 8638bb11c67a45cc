"""One module per op family; importing them fills the registry."""
from . import softmax  # noqa: F401
