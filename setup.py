import re
from pathlib import Path

from setuptools import find_packages, setup


# the one version: the code version every saved folder records (read as text: building imports no torch)
CONFIGURATION = Path(__file__).parent / "modeling_pkm_bert" / "configuration_bert_pkm.py"
VERSION = re.search(r'^PKM_CODE_VERSION = "([^"]+)"$', CONFIGURATION.read_text(encoding="utf-8"), re.M).group(1)

setup(
    name="modeling-pkm-bert",
    version=VERSION,
    description="Product key memory (PKM) for BERT in the Hugging Face ecosystem (Kim & Jung 2020, Lample et al. 2019)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["modeling_pkm_bert", "modeling_pkm_bert.*"]),
    package_data={
        "modeling_pkm_bert.kernels": ["csrc/*.c"],
        "modeling_pkm_bert.analysis": ["explorer_page/*.html", "explorer_page/*.css", "explorer_page/*.js"],
    },
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.13,<3",  # the torch CI installs (constraints*.txt); FSDP2 needs >= 2.6
        "transformers>=5.4,<6",
        "huggingface_hub>=1.5,<3",
        "safetensors>=0.4,<1",
        "numpy>=1.26,<3",
    ],
    extras_require={
        "scripts": [
            "accelerate>=1.10,<2",
            "datasets>=4,<6",
            "scikit-learn>=1.5,<2",
            "scipy>=1.13,<2",
            "tqdm>=4.66,<5",
            "matplotlib>=3.8,<4",
        ],
        "dev": [
            "accelerate>=1.10,<2",
            "datasets>=4,<6",
            "scikit-learn>=1.5,<2",
            "scipy>=1.13,<2",
            "tqdm>=4.66,<5",
            "matplotlib>=3.8,<4",
            "pytest>=8,<10",
            "ruff==0.17.6",  # the lint rules of ruff.toml, pinned: a new release may add checks (tests/repo/test_layout.py)
            "parameterized>=0.9,<1",  # imported by transformers' common tests (tests/models/test_transformers_common.py)
            "tensorboard>=2.15,<3",  # the real tracker of tests/repo/test_security.py (no secret reaches it)
            "product-key-memory==0.3.0",
            # integrations (modeling_pkm_bert/integrations, tests/layer/test_export.py, tests/models/test_integrations.py)
            "peft>=0.15,<1",
            "sentence-transformers>=6,<7",
            "onnx>=1.17,<2",
            "onnxruntime>=1.20,<2",
            "onnxscript>=0.5,<1",
        ],
    },
)
