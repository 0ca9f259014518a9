"""Import torchvision without its compiled extension (used by the Opacus suite's generated conftest and by
``tests/test_torchvision_models.py``'s worker process).

The only torchvision wheels the registry has are linked against CUDA torch: their ``_C`` extension does not
load with the CPU build, and torchvision's own import then fails registering fake kernels for two operators
``_C`` would have defined. Defining those two schemas first (never called: no detection model runs) lets the
pure-Python parts import (models, transforms, FakeData)."""

import importlib.util
import sys


def import_torchvision_without_extension():
    """Import torchvision; return the ``torch.library.Library`` that defines the two schemas (keep it alive
    while torchvision is used), or None when no definition was needed or torchvision is absent."""
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision  # noqa: F401

        return None
    except RuntimeError as error:
        if "torchvision::nms" not in str(error):
            raise
    for name in [name for name in sys.modules if name == "torchvision" or name.startswith("torchvision.")]:
        del sys.modules[name]
    import torch

    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision  # noqa: F401

    return library
