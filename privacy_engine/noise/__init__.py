"""Noise mechanisms: independent Gaussian noise (DP-SGD) and banded matrix factorisation (BandMF).

Both mechanisms share one interface: the optimizer hands over the clipped, summed gradients of
all parameters (one tensor per parameter) and the mechanism adds this step's noise in place.

Where things are:

* ``mechanism.py``: ``NoiseMechanism``, the base class: argument checks, the transactional step
  (``add_noise_``), per-device generators, reseeding, drawing the next step's noise ahead.
* ``layout.py``: how the tensors are laid out per device (``_DeviceGroup``) and how each
  device's generators are seeded.
* ``state.py``: saving, checking and restoring a mechanism's state (``state_dict``).
* ``gaussian.py``: ``GaussianNoise`` (DP-SGD).
* ``bandmf.py``: ``BandMFNoise`` (banded matrix factorisation, correlated across steps).
* ``blt.py``: ``BLTNoise`` (buffered-linear-Toeplitz noise, streamed with a few buffers), its strategies'
  loss, sensitivity and optimiser, and its event kind ``"blt"`` (un-amplified).
* ``strategy.py``: BandMF's banded Toeplitz strategies: their error and the optimiser that picks them.
* ``prefetch.py``: the background thread that draws the next step's noise while the step runs.
* ``counter_stream.py``: the counter-keyed noise stream (``noise_stream="counter-v1"``), drawn on several
  threads with the same numbers at any thread count; ``"mt19937"`` (one serial generator) stays the default.
* ``secure_random.py``: OS randomness for ``secure_mode`` (full-entropy generators and choices).

Each mechanism states its privacy event (``privacy_event()``, an ``accountants.events.EventSpec``: an
event kind, the cyclic sampling it needs and the kind's parameters; ``dp_event(...)`` builds the
dp-accounting event from it). The accountant records and composes exactly that. A new mechanism (BLT
next) is one new file here: a ``NoiseMechanism`` subclass with its noise, its per-step state through the
base class's hooks, and its ``privacy_event``; if its analysis is not an existing kind, the event builder
registered in the same file (``accountants.events.register_event_kind``). Then its export below (and its
name in the engine's ``noise_mechanism`` choices, to select it by name).
"""

from privacy_engine.noise.bandmf import BandMFNoise
from privacy_engine.noise.blt import BLTNoise, BLTStrategy
from privacy_engine.noise.gaussian import GaussianNoise
from privacy_engine.noise.mechanism import NoiseMechanism

__all__ = ["BLTNoise", "BLTStrategy", "BandMFNoise", "GaussianNoise", "NoiseMechanism"]
