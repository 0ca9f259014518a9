"""The drawn batch, the lowest stage of the data path: which draw of a private loader a tensor holds.

Every stage above reads it: the loader (``privacy_engine.training.data_loader``) issues the tickets,
the wrappers (``privacy_engine.capture``) ask which batch each forward ran on, the optimizer's step
contract (``privacy_engine.training.step_contract``) decides what a step releases. It imports nothing
of the package.

* ``tickets.py``: ``BatchTicket`` (a draw, or rows of one), tagging tensors with it (``tag_batch``,
  ``move_to``), finding it again on views and copies (``find_ticket``, ``row_runs``), and the queue of
  a loader's yielded batches (``TicketQueue``).
* ``users.py``: user-level privacy's users: the user of every example (``user_assignment``) and which
  of a sampled user's examples a step holds (``UserCycles``, cycling as JAX Privacy does).
"""

from privacy_engine.batches.tickets import BatchTicket, move_to

__all__ = ["BatchTicket", "move_to"]
