"""The engine: make a model, its optimizer and its data loader private in one call, and keep the
privacy ledger::

    engine = PrivacyEngine(accountant="pld")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
    )
    ...  # the usual training loop
    engine.get_epsilon(delta=1e-5)

The keywords are those Opacus uses for the same settings (``module=``, ``data_loader=``,
``grad_sample_mode=``, ``noise_generator=``, ...), so a script written for Opacus switches by changing
its import. BandMF:
``noise_mechanism="bandmf"`` (with ``num_bands=b``, or, with ``make_private_with_epsilon``, none to let the
engine choose; ``max_batch_size=`` for fixed-shape, truncated batches); ``noise_mechanism="blt"`` (BLT noise,
``num_buffers=``); ``make_private_with_epsilon(noise_mechanism="auto")`` picks among DP-SGD, BandMF and BLT
(``mechanism_choice``); ``engine.noise_plan`` says what was set up.

The modules, in the order of a ``make_private`` call:

- ``options``: ``PrivacyOptions``, every setting, validated with errors that name the field
  (``typed_settings``: the same settings as ``TypedDict`` classes, for static type checkers);
- ``plan``: options + model, optimizer, loader -> what will be built (noise mechanism, sampling, sigma),
  with ``bands`` (BandMF's number of bands) and ``calibration`` (sigma for an epsilon target);
- ``build``: the private optimizer, then the wrapped model (``make_private`` returns
  ``(module, optimizer, data_loader)`` in every mode), then ``connect``: ``connect_private`` ties that
  one wrapper, optimizer and loader together (the one function that does; hand-built pipelines call it);
  ``sharded`` instead for a ``fully_shard`` (FSDP2) model: ghost clipping on the shards, the model itself
  returned with ``training.fsdp_private.FSDPPrivateOptimizer``;
- ``privacy_engine``: ``PrivacyEngine``, which runs the three and keeps the ledger (``ledger``,
  ``budget``); ``checkpoint`` saves and restores a run.
"""

from privacy_engine.engine.bands import CANDIDATE_NUM_BANDS
from privacy_engine.engine.budget import PrivacyBudget, PrivacyBudgetExceeded
from privacy_engine.engine.noise_plan import BandCandidate, NoisePlan
from privacy_engine.engine.options import PerformanceFlags, PrivacyOptions
from privacy_engine.engine.privacy_engine import PrivacyEngine

__all__ = [
    "CANDIDATE_NUM_BANDS",
    "BandCandidate",
    "NoisePlan",
    "PerformanceFlags",
    "PrivacyBudget",
    "PrivacyBudgetExceeded",
    "PrivacyEngine",
    "PrivacyOptions",
]
