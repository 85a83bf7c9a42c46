"""tvm_fusion: DNNFusion, Apollo, OptiFX and SmartMem fusion passes for Apache TVM (Relax)."""

from setuptools import find_packages, setup

# The pins are not cosmetic: apache-tvm-ffi 0.1.15.x segfaults in every JSON serialisation
# (meta_schedule databases, ConvertLayout to NCHW4c, tvm.ir.save_json); see docs/platform.md.
INSTALL_REQUIRES = [
    "apache-tvm==0.27.0.post1",
    "apache-tvm-ffi==0.1.14.post0",
    "onnx>=1.16",
    "numpy",
    "xgboost",
    "tornado",
    "cloudpickle",
    "psutil",
    "tqdm",
]

EXTRAS = {
    "bench": ["onnxruntime", "matplotlib"],
    # torchvision from PyPI is a CUDA build; with CPU torch its ops do not load, which
    # scripts/export_models.py works around (it needs only the model definitions).
    "models": ["torch==2.13.0", "torchvision==0.28.0", "transformers", "timm", "onnxscript"],
    "opencl": ["pyopencl"],
    "dev": ["pytest", "pytest-timeout", "hypothesis", "ruff", "onnxruntime", "matplotlib",
            # tutorials/*.ipynb are executed by tests/test_tutorials.py
            "nbclient", "nbformat", "ipykernel",
            # meta_schedule prints its task table through pandas inside a notebook (tutorial 5)
            "pandas"],
}

setup(
    name="tvm_fusion",
    version="0.1.0",
    description=__doc__,
    packages=find_packages(include=["tvm_fusion", "tvm_fusion.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["tvm-fusion=tvm_fusion.cli:main"]},
)
