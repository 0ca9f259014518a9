"""The keyword settings of this namespace's ``PrivacyEngine.make_private`` and
``make_private_with_epsilon`` as ``TypedDict``s, for static type checkers: the engine's
(``privacy_engine.engine.typed_settings``) and Opacus's ghost-mode ``criterion``, which the engine's
own entry points refuse (they return three values in every mode, so there is no criterion to hand
back). ``tests/test_public_typing.py`` compares them with the engine's settings and the runtime
signatures.
"""

# No ``from __future__ import annotations`` here: the classes are built from evaluated annotations,
# so that ``__required_keys__`` sees ``NotRequired`` (as in the engine's typed_settings).
from typing import Any

from typing_extensions import NotRequired

from privacy_engine.engine.typed_settings import MakePrivateSettings, MakePrivateWithEpsilonSettings

__all__ = ["OpacusMakePrivateSettings", "OpacusMakePrivateWithEpsilonSettings"]


class OpacusMakePrivateSettings(MakePrivateSettings):
    """``privacy_engine.opacus.PrivacyEngine.make_private``'s settings: the engine's and ``criterion``."""

    criterion: NotRequired[Any]


class OpacusMakePrivateWithEpsilonSettings(MakePrivateWithEpsilonSettings):
    """``privacy_engine.opacus.PrivacyEngine.make_private_with_epsilon``'s settings: the engine's and
    ``criterion``."""

    criterion: NotRequired[Any]
