from setuptools import find_packages, setup

setup(
    name="privacy-engine",
    version="0.1.0",
    description="Differentially private training for PyTorch: exact per-sample gradients, "
    "clipping, Gaussian and BandMF noise, dp-accounting accountants.",
    # Subpackages too (privacy_engine.opacus, privacy_engine.integrations, ...).
    packages=find_packages(include=["privacy_engine", "privacy_engine.*", "grad_samplers", "grad_samplers.*",
                                    "accountants", "accountants.*"]),
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
        "test": ["pytest", "hypothesis", "scikit-learn"],
        "hf": ["transformers>=4.40", "peft>=0.10", "accelerate>=0.26"],
    },
)
