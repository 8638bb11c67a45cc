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
    # recognized but not replaced: {"module", "op", "why", "strict"}; strict: a fused op exists for it but its
    # equivalence was not proven (gems.patch(strict=True) raises); not strict: no fused form for that structure
    left: list = field(default_factory=list)
    _undo: list = field(default_factory=list, repr=False)   # see log_module / log_attr

    def add(self, op: str, name: str):
        self.replaced.setdefault(op, []).append(name or "<model>")

    def leave(self, name: str, op: str, why: str, strict: bool = True):
        self.left.append({"module": name or "<model>", "op": op, "why": why, "strict": strict})

    def unproven(self) -> list:
        """The left entries that gems.patch(strict=True) refuses."""
        return [e for e in self.left if e["strict"]]

    def counts(self) -> dict:
        return {k: len(v) for k, v in self.replaced.items()}

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, "options": dict(self.options), "replaced": self.counts(),
                "modules": {k: list(v) for k, v in self.replaced.items()}, "notes": list(self.notes),
                "left": [dict(e) for e in self.left]}

    def summary(self) -> str:
        parts = [f"{op} x{n}" for op, n in self.counts().items()]
        s = f"gems.patch({self.model_type}): " + (", ".join(parts) if parts else "nothing replaced")
        s += "".join(f"; {n}" for n in self.notes)
        un = self.unproven()
        if un:
            s += f"; {len(un)} part(s) not proven equivalent, left as is (first: {un[0]['module']}: {un[0]['why']})"
        return s

    __str__ = summary

    # undo records: ("module", parent, name, original) | ("attr", obj, name, had, old) | ("call", fn)
    def log_module(self, parent, name: str, old):
        """Record that `parent._modules[name]` held `old` before it was replaced."""
        self._undo.append(("module", parent, name, old))

    def log_attr(self, obj, name: str):
        """Record `obj.__dict__[name]` (or its absence) before it is set."""
        self._undo.append(("attr", obj, name, name in obj.__dict__, obj.__dict__.get(name)))

    def log_call(self, fn):
        """Record a function that undoes a change no attribute holds (Parameters' storage layout)."""
        self._undo.append(("call", fn))

    def undo(self):
        """Put back every recorded module and attribute, newest first: the exact original objects."""
        for rec in reversed(self._undo):
            if rec[0] == "module":
                _, parent, name, old = rec
                parent._modules[name] = old
            elif rec[0] == "call":
                rec[1]()
            else:
                _, obj, name, had, old = rec
                if had:
                    object.__setattr__(obj, name, old)
                else:
                    obj.__dict__.pop(name, None)
        self._undo.clear()

