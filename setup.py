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
    package_data={"tfhybrid.oracle": ["machines/*.json"]},
    include_package_data=True,
    install_requires=[
        "tensorflow-cpu==2.18.1",
        "keras>=3.8,<3.16",
        "numpy>=1.26,<2.1",
        # horovod==0.28.1 must be built from source against the TensorFlow
        # above (HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1); see
        # scripts/setup_env.sh, which builds and caches the wheel.
    ],
    extras_require={
        "horovod": ["horovod==0.28.1"],
        "plot": ["matplotlib>=3.8"],
        "test": ["pytest>=8", "scikit-learn>=1.4"],
    },
    entry_points={"console_scripts": ["tfhybrid=tfhybrid.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
