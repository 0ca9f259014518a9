"""``opacus.utils.batch_memory_manager.BatchMemoryManager``: the engine's ``VirtualSteps`` (the same
keyword arguments; each logical batch is split into physical batches of at most
``max_physical_batch_size``, and the optimizer releases one step per logical batch), with Opacus's
``len()``: the number of physical batches, not of logical ones."""

from __future__ import annotations

import math

from privacy_engine.training.virtual_steps import VirtualSteps

__all__ = ["BatchMemoryManager"]


class BatchMemoryManager(VirtualSteps):
    """``VirtualSteps`` (see ``privacy_engine.training.virtual_steps``) whose ``len()`` counts physical
    batches, as Opacus's does. What is released and accounted is ``VirtualSteps``'s, unchanged."""

    def __len__(self) -> int:
        """Physical batches in one pass. Fixed-size batches: each batch of ``b`` examples gives
        ``ceil(b / max_physical_batch_size)`` (a last, smaller batch counted by its own size), which
        is exact. Poisson batches: the count depends on the draw; the expected batch size (the
        optimizer's ``expected_batch_size``) stands in for ``b``, so it is an estimate (each logical
        batch, empty or not, gives at least one physical batch)."""
        physical = self.max_physical_batch_size
        batch_size = getattr(self.data_loader, "batch_size", None)
        if batch_size:
            total = len(self.data_loader) * math.ceil(batch_size / physical)
            dataset = getattr(self.data_loader, "dataset", None)
            try:
                examples = len(dataset)
            except TypeError:
                return total
            remainder = examples % batch_size
            if remainder and not getattr(self.data_loader, "drop_last", False) and len(self.data_loader) == math.ceil(examples / batch_size):
                total -= math.ceil(batch_size / physical) - math.ceil(remainder / physical)
            return total
        expected = getattr(self.optimizer, "expected_batch_size", None)
        if not expected:
            return len(self.data_loader)
        return len(self.data_loader) * max(1, math.ceil(expected / physical))
