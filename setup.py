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
    # or `tfhybrid[gpu]` (tensorflow[and-cuda]: the CUDA, cuDNN and NCCL wheels
    # that TensorFlow pins). The two TensorFlow distributions install the same
    # package, so neither is a base requirement. The range is the TensorFlow
    # versions horovod 0.28.1 builds against with patches/horovod/ applied
    # (2.18 to 2.21); each TensorFlow narrows Keras and numpy further itself.
    # scripts/setup_env.sh chooses the device by TFHYBRID_DEVICE or the NVIDIA
    # driver and the version by TFHYBRID_TF.
    install_requires=[
        "keras>=3.8,<3.16",
        "numpy>=1.26,<2.5",
        # horovod==0.28.1 must be built from source against the TensorFlow
        # of the extra (HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1, plus
        # HOROVOD_GPU_OPERATIONS=NCCL on GPU), and for TensorFlow 2.19+ with
        # patches/horovod/ applied; see scripts/setup_env.sh, which builds and
        # caches the wheel per TensorFlow version, device and patch set.
    ],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.18.1,<2.22"],
        "gpu": ["tensorflow[and-cuda]>=2.18.1,<2.22"],
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
