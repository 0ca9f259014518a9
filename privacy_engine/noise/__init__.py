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
* ``strategy.py``: BandMF's banded Toeplitz strategies: their error and the optimiser that picks them.
* ``prefetch.py``: the background thread that draws the next step's noise while the step runs.
* ``secure_random.py``: OS randomness for ``secure_mode`` (full-entropy generators and choices).
"""

from privacy_engine.noise.bandmf import BandMFNoise
from privacy_engine.noise.gaussian import GaussianNoise
from privacy_engine.noise.mechanism import NoiseMechanism

__all__ = ["BandMFNoise", "GaussianNoise", "NoiseMechanism"]
