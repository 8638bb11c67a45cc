"""What `gems.patch` replaced in a model, and the log that `gems.unpatch` replays to put it back."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PatchReport:
    """What `gems.patch` replaced: per fused op, the qualified names of the modules it now runs in."""

    model_type: str
    options: dict
    replaced: dict = field(default_factory=dict)    # fused op -> [module names]
    notes: list = field(default_factory=list)       # what was left alone, and why
    _undo: list = field(default_factory=list, repr=False)   # see log_module / log_attr

    def add(self, op: str, name: str):
        self.replaced.setdefault(op, []).append(name or "<model>")

    def counts(self) -> dict:
        return {k: len(v) for k, v in self.replaced.items()}

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, "options": dict(self.options), "replaced": self.counts(),
                "modules": {k: list(v) for k, v in self.replaced.items()}, "notes": list(self.notes)}

    def summary(self) -> str:
        parts = [f"{op} x{n}" for op, n in self.counts().items()]
        s = f"gems.patch({self.model_type}): " + (", ".join(parts) if parts else "nothing replaced")
        return s + "".join(f"; {n}" for n in self.notes)

    __str__ = summary

    # undo records: ("module", parent, name, original) | ("attr", obj, name, had, old)
    def log_module(self, parent, name: str, old):
        """Record that `parent._modules[name]` held `old` before it was replaced."""
        self._undo.append(("module", parent, name, old))

    def log_attr(self, obj, name: str):
        """Record `obj.__dict__[name]` (or its absence) before it is set."""
        self._undo.append(("attr", obj, name, name in obj.__dict__, obj.__dict__.get(name)))

    def undo(self):
        """Put back every recorded module and attribute, newest first: the exact original objects."""
        for rec in reversed(self._undo):
            if rec[0] == "module":
                _, parent, name, old = rec
                parent._modules[name] = old
            else:
                _, obj, name, had, old = rec
                if had:
                    object.__setattr__(obj, name, old)
                else:
                    obj.__dict__.pop(name, None)
        self._undo.clear()

