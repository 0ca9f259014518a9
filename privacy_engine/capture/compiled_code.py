"""Why a layer's hooks may not have run: code that ``torch.compile`` compiled for another model of the same
class.

``torch.compile`` keeps the code it compiles on the Python code object of each traced ``forward``, shared
by every instance of the class. Compile a plain model, then wrap another model of the same class and
compile (or run under a compiled caller) the private one: torch finds the cached code for that
``forward``, its guards accept the new instance, and it runs without the forward hooks the wrapper
installed. The layers inside then produce no per-sample gradient, and the first backward's check (or fast
clipping's gradient hook) finds a parameter whose gradient nothing explains. ``stale_compilation_note``
says so in that error, with the way out (``torch.compiler.reset()`` before compiling the private model).

It reads torch's per-code cache (``torch._dynamo.eval_frame._debug_get_cache_entry_list``, a private
function present in torch 2.1 to 2.13); where it is missing, no note is given.
"""

from __future__ import annotations

from torch import nn

__all__ = ["stale_compilation_note"]


def _compiled_entries(code) -> int:
    try:
        from torch._dynamo.eval_frame import (
            _debug_get_cache_entry_list,  # deferred: torch internals, imported only when needed
        )
    except ImportError:
        return 0
    try:
        return len(_debug_get_cache_entry_list(code))
    except (TypeError, RuntimeError):
        return 0


def stale_compilation_note(root: nn.Module, path: str | None) -> str:
    """A sentence for a "used outside the forward" error about the module at ``path`` of ``root``: when
    ``torch.compile`` holds compiled code for the ``forward`` of that module's class or of one of its
    ancestors' (the wrapped model's included), the likely cause, and the way out; "" otherwise.

    The note only explains: the error is raised either way (the per-sample gradients are missing)."""
    modules = [root]
    if path:
        module = root
        for name in path.split("."):
            module = getattr(module, name, None)
            if not isinstance(module, nn.Module):
                break
            modules.append(module)
    compiled = []
    for module in modules:
        forward = getattr(type(module), "forward", None)
        code = getattr(forward, "__code__", None)
        if code is not None and _compiled_entries(code) and type(module).__qualname__ not in compiled:
            compiled.append(type(module).__qualname__)
    if not compiled:
        return ""
    return (
        f" torch.compile holds compiled code for {', '.join(c + '.forward' for c in compiled)}: if it was compiled "
        f"for another model of the same class (a plain model compiled before this one was wrapped), torch "
        f"reuses that code here and it runs without the engine's hooks, which is the likely cause. Call "
        f"torch.compiler.reset() before compiling or running the private model (or compile it in a process "
        f"that compiled no plain model of these classes)."
    )
