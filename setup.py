import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def read_version() -> str:
    """``__version__`` from privacy_engine/__init__.py, read as text (setup.py cannot import the package:
    its dependencies may not be installed yet). The one place the version is written."""
    text = (HERE / "privacy_engine" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"$', text, flags=re.MULTILINE)
    if match is None:
        raise RuntimeError("privacy_engine/__init__.py has no line __version__ = \"...\"")
    return match.group(1)


setup(
    name="privacy-engine",
    version=read_version(),
    description="Differentially private training for PyTorch: exact per-sample gradients, "
    "clipping, Gaussian and BandMF noise, dp-accounting accountants.",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    # No public source repository yet: the package's index page. Replace with the repository's address.
    url="https://pypi.org/project/privacy-engine/",
    author="The privacy-engine authors",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: Security",
        "Typing :: Typed",
    ],
    keywords=["differential privacy", "DP-SGD", "pytorch", "opacus", "per-sample gradients"],
    # Subpackages too (privacy_engine.opacus, privacy_engine.integrations, ...).
    packages=find_packages(include=["privacy_engine", "privacy_engine.*", "grad_samplers", "grad_samplers.*",
                                    "accountants", "accountants.*"]),
    # PEP 561: the packages ship their type hints (py.typed), and the stubs of the namespaced aliases.
    package_data={"privacy_engine": ["py.typed", "*.pyi"], "accountants": ["py.typed"], "grad_samplers": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.2",
        "numpy",
        "scipy",
        "dp-accounting>=0.6",
        "tqdm",
    ],
    extras_require={
        "tutorials": ["scikit-learn", "matplotlib"],
        "benchmarks": ["opacus>=1.5"],
        "test": ["pytest", "hypothesis", "scikit-learn", "opacus>=1.6"],
        "hf": ["transformers>=4.40", "peft>=0.10", "accelerate>=0.26"],
        # The API reference imports every documented module, privacy_engine.integrations.hf_trainer
        # (transformers) included: install with the "hf" extra.
        "docs": ["sphinx>=8", "myst-parser>=4"],
    },
)
