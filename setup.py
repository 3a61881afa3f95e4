from setuptools import find_packages, setup

setup(
    name="easyckpt",
    version="0.1.0",
    description="Near-free checkpoints for large PyTorch training: shared-memory snapshots, "
                "background persistence, loss-free resume",
    packages=find_packages(include=["easyckpt", "easyckpt.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy", "safetensors>=0.4", "xxhash>=3"],
    extras_require={
        "megatron": ["megatron-core>=0.16,<0.17", "six", "einops", "pyyaml", "regex", "pydantic", "psutil"],
        "deepspeed": ["deepspeed>=0.19"],
        "transformers": ["transformers>=5", "accelerate>=1"],
        "test": ["pytest>=8", "pytest-timeout", "import-linter>=2"],
        "bench": ["matplotlib"],
        "all": ["megatron-core>=0.16,<0.17", "six", "einops", "pyyaml", "regex", "pydantic", "psutil",
                "deepspeed>=0.19", "transformers>=5", "accelerate>=1"],
    },
    entry_points={"console_scripts": ["easyckpt=easyckpt.cli:main"]},
)
