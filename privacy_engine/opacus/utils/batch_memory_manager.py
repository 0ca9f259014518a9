"""``opacus.utils.batch_memory_manager.BatchMemoryManager``: the engine's ``VirtualSteps`` (the same
keyword arguments; each logical batch is split into physical batches of at most
``max_physical_batch_size``, and the optimizer releases one step per logical batch)."""

from privacy_engine.training.virtual_steps import VirtualSteps

__all__ = ["BatchMemoryManager"]

#: Opacus's name for the engine's ``VirtualSteps`` (the same class, the same keywords).
BatchMemoryManager = VirtualSteps
