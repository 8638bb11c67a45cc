"""`--device cpu` for a benchmark: Gems' kernels run under the Triton interpreter, which triton fixes when it
is imported. So the choice is made before `import triton` (gems imports it), and in a process whose triton
was already imported for the GPU it is refused: setting TRITON_INTERPRET there would leave later Gems calls
of that process facing a changed environment (gems.runtime.backends.check_environment raises)."""
import os
import sys


def use_interpreter_for(device: str) -> None:
    """Before triton is imported: device 'cpu' selects the interpreter. Raises SystemExit (with why) when
    triton is already imported without it; a no-op for other devices."""
    if device != "cpu":
        return
    if "triton.language.standard" not in sys.modules:   # what triton_interprets reads: nothing chosen yet
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return
    from gems.runtime.backends import triton_interprets   # triton is in already: importing gems chooses nothing
    if not triton_interprets():
        raise SystemExit("--device cpu runs Gems under the Triton interpreter, which must be chosen before triton "
                         "is imported; this process imported triton for the GPU: run the CPU benchmark in its own "
                         "process (or with TRITON_INTERPRET=1 set from the start)")
