"""What static type checkers read: the settings of ``make_private`` / ``make_private_with_epsilon`` as
``TypedDict``s (``engine/typed_settings.py``) agree with ``PrivacyOptions`` and ``ENTRY_POINTS``, and
with the runtime signatures; the package ships ``py.typed``; the version is written once."""

from __future__ import annotations

import dataclasses
import inspect
import re
import runpy
import typing
from pathlib import Path

import pytest
import setuptools
from typing_extensions import get_type_hints

import privacy_engine
from privacy_engine.engine import options
from privacy_engine.engine import typed_settings as typed
from privacy_engine.engine.options import ENTRY_POINTS, PrivacyOptions
from privacy_engine.opacus import PrivacyEngine as OpacusPrivacyEngine
from privacy_engine.opacus import typed_settings as opacus_typed

ROOT = Path(__file__).resolve().parents[1]
#: The settings the Opacus namespace adds to the engine's (not ``PrivacyOptions`` fields), with their types.
OPACUS_ONLY = {"criterion": typing.Any}
SETTINGS = {
    ("engine", "make_private"): (typed.MakePrivateSettings, privacy_engine.PrivacyEngine),
    ("engine", "make_private_with_epsilon"): (typed.MakePrivateWithEpsilonSettings, privacy_engine.PrivacyEngine),
    ("opacus", "make_private"): (opacus_typed.OpacusMakePrivateSettings, OpacusPrivacyEngine),
    ("opacus", "make_private_with_epsilon"): (
        opacus_typed.OpacusMakePrivateWithEpsilonSettings, OpacusPrivacyEngine,
    ),
}


def field_types(namespace: str = "engine") -> dict[str, object]:
    hints = typing.get_type_hints(PrivacyOptions, vars(options))
    types = {field.name: hints[field.name] for field in dataclasses.fields(PrivacyOptions)}
    return {**types, **OPACUS_ONLY} if namespace == "opacus" else types


def expected_keys(namespace: str, entry_point: str) -> tuple[set[str], set[str]]:
    """(every setting, the required ones) of ``entry_point`` by ``ENTRY_POINTS`` and the dataclass
    (and, in the Opacus namespace, ``OPACUS_ONLY``)."""
    required, refused = ENTRY_POINTS[entry_point]
    names = {name for name in field_types(namespace) if name not in refused}
    return names, set(required)


@pytest.mark.parametrize(("namespace", "entry_point"), SETTINGS)
def test_typed_settings_have_exactly_the_settings_and_required_ones(namespace, entry_point):
    settings, _ = SETTINGS[namespace, entry_point]
    names, required = expected_keys(namespace, entry_point)
    assert set(settings.__required_keys__) | set(settings.__optional_keys__) == names
    assert set(settings.__required_keys__) == required


@pytest.mark.parametrize(("namespace", "entry_point"), SETTINGS)
def test_typed_settings_have_the_field_types(namespace, entry_point):
    """Each type is the field's; a required setting may drop the field's ``None`` (it must be given)."""
    settings, _ = SETTINGS[namespace, entry_point]
    fields = field_types(namespace)
    for name, hint in get_type_hints(settings).items():
        if name in settings.__required_keys__:
            assert fields[name] in (hint, hint | None), name
        else:
            assert hint == fields[name], name


@pytest.mark.parametrize(("namespace", "entry_point"), SETTINGS)
def test_runtime_signature_takes_the_typed_settings(namespace, entry_point):
    settings, engine_class = SETTINGS[namespace, entry_point]
    method = getattr(engine_class, entry_point)
    shown = {p.name for p in inspect.signature(method).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    names, _ = expected_keys(namespace, entry_point)
    assert names <= shown  # plus the objects' keywords (module, data_loader, wrap_model, ...)
    assert not (shown - names) & set(field_types(namespace))  # no setting the checker would not know
    # What a checker reads instead: **settings annotated with that TypedDict in the source.
    assert f"**settings: Unpack[{settings.__name__}]" in inspect.getsource(method)


def test_the_package_ships_py_typed_and_the_alias_stubs():
    setup = (ROOT / "setup.py").read_text()
    for package in ("privacy_engine", "accountants", "grad_samplers"):
        assert (ROOT / package / "py.typed").is_file()
        assert re.search(rf'"{package}": \[[^\]]*"py\.typed"', setup), package
    for alias in ("accountants", "grad_samplers"):
        assert (ROOT / "privacy_engine" / f"{alias}.pyi").is_file()
    assert '"*.pyi"' in setup


def test_setup_reads_the_version_and_states_the_metadata(monkeypatch):
    """setup.py run with ``setuptools.setup`` replaced by a recorder: the version is
    ``privacy_engine.__version__`` (written once), and the metadata ``pip show`` prints is there."""
    recorded: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: recorded.update(kwargs))
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    assert recorded["version"] == privacy_engine.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", privacy_engine.__version__)
    assert f"## {privacy_engine.__version__}" in (ROOT / "CHANGELOG.md").read_text()
    assert not re.search(r"version\s*=\s*[\"']", (ROOT / "setup.py").read_text())  # no second copy
    assert recorded["license"] == "Apache-2.0" and (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert recorded["url"] and recorded["author"]
    assert recorded["long_description"] == (ROOT / "README.md").read_text()
    assert "Typing :: Typed" in recorded["classifiers"]
