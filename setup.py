"""ds_stpar: spatial-temporal tensor partitioning, a layout planner and sequence-length
bucketing with parallelism hot switching for DeepSpeed and Megatron-core."""

from setuptools import find_packages, setup

# torch is deliberately unpinned here: GPU users keep their CUDA build. CI pins the CPU
# build (torch==2.13.0) on its own pip line.
EXTRAS = {
    "megatron": ["megatron-core==0.16.1"],
    "deepspeed": ["deepspeed>=0.16"],
    "hf": ["transformers>=4.46", "accelerate>=1.0", "datasets>=3.0", "tokenizers>=0.20"],
    "plot": ["matplotlib>=3.7"],
    "test": ["pytest>=8", "ruff>=0.6"],
}
EXTRAS["all"] = sorted(
    {req for key in ("megatron", "deepspeed", "hf", "plot") for req in EXTRAS[key]}
)

setup(
    name="ds_stpar",
    version="0.1.0",
    description=__doc__,
    packages=find_packages(include=["ds_stpar", "ds_stpar.*"]),
    package_data={"ds_stpar": ["data/*.json"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["ds-stpar=ds_stpar.cli:main"]},
)
