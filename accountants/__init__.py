"""Privacy accounting on Google's dp-accounting.

Accountants record training steps (DP-SGD, or BandMF with cyclic Poisson sampling, optionally
truncated) and report epsilon with dp-accounting's RDP or PLD analysis; no privacy maths is done
here. `calibrate_noise_multiplier` finds the smallest noise multiplier for a target.

    from accountants import make_accountant, calibrate_noise_multiplier
    sigma = calibrate_noise_multiplier(3.0, 1e-5, sample_rate=0.01, steps=1000)
    accountant = make_accountant("pld")
    accountant.step(noise_multiplier=sigma, sample_rate=0.01, num_steps=1000)
    accountant.get_epsilon(1e-5)  # <= 3.0
"""

from accountants.base import Accountant
from accountants.calibration import CalibrationError, calibrate_noise_multiplier
from accountants.events import (
    bandmf_event,
    dpsgd_event,
    max_participations,
    truncated_bandmf_event,
)
from accountants.history import HistoryEntry
from accountants.pld import PLDAccountant
from accountants.rdp import RDPAccountant
from accountants.registry import ACCOUNTANTS, make_accountant

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "CalibrationError",
    "HistoryEntry",
    "PLDAccountant",
    "RDPAccountant",
    "bandmf_event",
    "calibrate_noise_multiplier",
    "dpsgd_event",
    "make_accountant",
    "max_participations",
    "truncated_bandmf_event",
]
