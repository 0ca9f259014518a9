"""Saving and restoring an accountant's state: `fresh`, `state_dict` and `load_state_dict` of every
`Accountant` (mixed into the base class), and what copies and pickles of one carry.

The state is made of JSON types: the accountant's kind (`name`), its settings (constructor keyword
arguments) and its history (`HistoryEntry.to_dict`), under the format tag `STATE_DICT_FORMAT`.
Loading validates everything before anything changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accountants.history import HistoryEntry

if TYPE_CHECKING:
    from accountants.base import Accountant

__all__ = ["STATE_DICT_FORMAT", "AccountantStateMixin"]

STATE_DICT_FORMAT = "privacy_engine.accountants/1"


class AccountantStateMixin:
    """The checkpointing half of `Accountant` (which defines every attribute used here)."""

    # ----------------------------------------------------------------- checkpoints
    def fresh(self) -> Accountant:
        """An empty accountant of the same kind and settings."""
        return type(self)(**self.settings())

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable state: kind, settings and history."""
        return {
            "format": STATE_DICT_FORMAT,
            "accountant": self.name,
            "settings": self.settings(),
            "history": [entry.to_dict() for entry in self._history],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace settings and history with those in `state_dict` (from `state_dict()`).

        Everything is validated first; on any error the accountant is left unchanged. Loading
        the state of another kind of accountant (an RDP state into a PLD accountant) raises
        ValueError: build the matching one with make_accountant(state_dict["accountant"]).
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"state_dict must be a dict; got {type(state_dict).__name__}."
            )
        missing = {"format", "accountant", "settings", "history"} - set(state_dict)
        if missing:
            raise ValueError(f"state_dict is missing keys {sorted(missing)}.")
        if state_dict["format"] != STATE_DICT_FORMAT:
            raise ValueError(
                f"state_dict['format'] is {state_dict['format']!r}; this version reads "
                f"{STATE_DICT_FORMAT!r}."
            )
        if state_dict["accountant"] != self.name:
            raise ValueError(
                f"state_dict['accountant'] is {state_dict['accountant']!r} but this is a "
                f"{self.name!r} accountant; use make_accountant({state_dict['accountant']!r}) "
                "and load into that."
            )
        settings = state_dict["settings"]
        if not isinstance(settings, dict):
            raise TypeError("state_dict['settings'] must be a dict.")
        # Validates the settings before anything changes.
        loaded = type(self)(**settings)
        if not isinstance(state_dict["history"], list | tuple):
            raise TypeError("state_dict['history'] must be a list of entries.")
        history = [HistoryEntry.from_dict(entry) for entry in state_dict["history"]]
        for entry in history:
            loaded._check_supported(entry)
        # Adopt the loaded settings wholesale: copying attribute by attribute would have to be
        # repeated in every subclass.
        self.__dict__.update(loaded.__dict__)
        self._history = history
        self._composed = None

    # ----------------------------------------------------------------- copies and pickles
    def __getstate__(self) -> dict[str, Any]:
        # Copies and pickles carry the ledger, not the cache: it is rebuilt on demand, and its
        # distributions (megabytes on the default PLD grid) have no place in a copy or a file.
        state = dict(self.__dict__)
        state["_history"] = list(self._history)
        state["_composed"] = None
        state["_cache"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cache = self._new_cache()
