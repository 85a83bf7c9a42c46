"""tvm_fusion: DNNFusion, Apollo, OptiFX and SmartMem fusion passes for Apache TVM (Relax)."""

from pathlib import Path

from setuptools import find_packages, setup

# The pins are not cosmetic (apache-tvm-ffi 0.1.15.x segfaults in every JSON serialisation):
# docs/design.md, "Pinned versions".
INSTALL_REQUIRES = [
    "apache-tvm==0.27.0.post1",
    "apache-tvm-ffi==0.1.14.post0",
    "onnx>=1.16",
    "numpy",
    # `import xgboost` without the ~470 MB nvidia-nccl-cu12 wheel (docs/design.md)
    "xgboost-cpu; sys_platform != 'darwin'",
    "xgboost; sys_platform == 'darwin'",
    "tornado",
    "cloudpickle",
    "psutil",
    "tqdm",
]

EXTRAS = {
    "bench": ["onnxruntime", "matplotlib"],
    # python -m tvm_fusion.export_models (the model zoo). torchvision from PyPI is a CUDA build;
    # with CPU torch its ops do not load, which the exporter works around (it needs only the
    # model definitions).
    "models": ["torch==2.13.0", "torchvision==0.28.0", "transformers", "timm", "onnxscript"],
    "opencl": ["pyopencl"],
    "dev": ["pytest", "pytest-timeout", "hypothesis", "ruff", "onnxruntime", "matplotlib",
            # tutorials/*.ipynb are executed by tests/test_tutorials.py
            "nbclient", "nbformat", "ipykernel",
            # meta_schedule prints its task table through pandas inside a notebook (tutorial 5)
            "pandas"],
}

CLASSIFIERS = [
    "Development Status :: 3 - Alpha",
    "Intended Audience :: Developers",
    "Intended Audience :: Science/Research",
    "Programming Language :: Python :: 3",
    "Programming Language :: Python :: 3 :: Only",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
    "Topic :: Software Development :: Compilers",
]

# The framework it extends and the papers it implements (DOIs as printed in the papers).
PROJECT_URLS = {
    "Apache TVM": "https://tvm.apache.org",
    "DNNFusion (PLDI'21)": "https://doi.org/10.1145/3453483.3454083",
    "SmartMem (ASPLOS'24)": "https://doi.org/10.1145/3620666.3651384",
}

setup(
    name="tvm_fusion",
    version="0.1.0",
    description=__doc__,
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license_expression="Apache-2.0",
    license_files=["LICENSE"],
    project_urls=PROJECT_URLS,
    classifiers=CLASSIFIERS,
    packages=find_packages(include=["tvm_fusion", "tvm_fusion.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["tvm-fusion=tvm_fusion.cli:main"]},
)
