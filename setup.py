from setuptools import find_packages, setup

setup(
    name="cgbackend",
    version="0.1.0",
    description="A torch.compile backend that brings CUDA graphs to models that are not fully static",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["cgbackend", "cgbackend.*"]),
    package_data={"cgbackend.passes.dispatch": ["costs.json"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "sympy"],
    extras_require={
        "test": ["pytest", "numpy", "transformers>=5"],
        "te": ["transformer-engine[pytorch]"],
    },
    entry_points={
        "torch_dynamo_backends": ["cgbackend = cgbackend.backend:dynamo_entry"],
        "console_scripts": ["cgbackend = cgbackend.cli:main"],
    },
)
