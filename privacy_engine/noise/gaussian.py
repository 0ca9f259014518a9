"""DP-SGD's noise: independent Gaussian noise on every entry, at every step (``GaussianNoise``)."""

from __future__ import annotations

from accountants.events import EventSpec
from privacy_engine.noise.mechanism import NoiseMechanism

__all__ = ["GaussianNoise"]


class GaussianNoise(NoiseMechanism):
    """DP-SGD noise: iid ``N(0, (noise_multiplier * max_grad_norm)^2)`` on every entry.

    Guarantee: with per-example gradients clipped to L2 norm ``max_grad_norm`` and summed, each
    step is the Gaussian mechanism with noise multiplier ``noise_multiplier`` (sensitivity
    ``max_grad_norm`` under add/remove of one example). Noise is independent across entries,
    tensors and steps.

    Args:
        seed: reproducible noise (per device, a derived stream). ``None``: seeded from torch's global
            generator (see ``NoiseMechanism``).
        secure_mode: OS-entropy seeds only (``seed`` must be None); see ``NoiseMechanism``.
    """

    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        """``noise_multiplier * max_grad_norm``; 0 when ``noise_multiplier`` is 0.

        ========================  =====================
        case                      result
        ========================  =====================
        noise_multiplier = 0      0.0 (no noise)
        max_grad_norm = inf       ValueError if sigma>0
        negative / NaN input      ValueError
        ========================  =====================
        """
        return self._validated_noise_scale(noise_multiplier, max_grad_norm)

    def privacy_event(self) -> EventSpec:
        """DP-SGD's event (``accountants.events.gaussian_event`` with one band): each step is the
        Gaussian mechanism with noise multiplier ``noise_multiplier`` on a sampled batch."""
        return EventSpec()

    def __repr__(self) -> str:
        return f"GaussianNoise(secure_mode={self.secure_mode}, step={self.step})"
