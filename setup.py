"""tfhybrid: hybrid data/model/spatial parallelism for unmodified Keras 3 models."""
from setuptools import find_packages, setup

setup(
    name="tfhybrid",
    version="0.1.0",
    description=("Hybrid data/model/spatial parallelism for Keras 3 on Horovod: "
                 "parallel layers, automatic model transformation, a distributed "
                 "optimizer and an analytical strategy oracle."),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["tfhybrid", "tfhybrid.*"]),
    package_data={"tfhybrid.oracle": ["machines/*.json"], "tfhybrid.docs": ["*.md"]},
    include_package_data=True,
    # TensorFlow comes from an extra: `pip install tfhybrid[cpu]` (tensorflow-cpu)
    # or `tfhybrid[gpu]` (tensorflow[and-cuda]: CUDA 12.5, cuDNN 9.3, NCCL 2.21.5
    # wheels pinned by TensorFlow 2.18.1). The two TensorFlow distributions
    # install the same package, so neither is a base requirement.
    # scripts/setup_env.sh chooses by TFHYBRID_DEVICE or the NVIDIA driver.
    install_requires=[
        "keras>=3.8,<3.16",
        "numpy>=1.26,<2.1",
        # horovod==0.28.1 must be built from source against the TensorFlow
        # of the extra (HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1, plus
        # HOROVOD_GPU_OPERATIONS=NCCL on GPU); see scripts/setup_env.sh,
        # which builds and caches the wheel per device.
    ],
    extras_require={
        "cpu": ["tensorflow-cpu==2.18.1"],
        "gpu": ["tensorflow[and-cuda]==2.18.1"],
        "horovod": ["horovod==0.28.1"],
        "plot": ["matplotlib>=3.8"],
        "test": ["pytest>=8", "scikit-learn>=1.4"],
        "docs": ["pdoc>=14"],
        "examples": ["absl-py>=1.0"],
    },
    entry_points={"console_scripts": ["tfhybrid=tfhybrid.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
