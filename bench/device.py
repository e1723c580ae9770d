"""``--device``, ``--dtype`` and ``--attention-backend`` of the end-to-end benches.

``bench.throughput``, ``bench.multi_lora``, ``bench.speculative`` and ``bench.mbu`` take the
same three options: the engine side gets them as ``EngineConfig(device=..., dtype=...,
attention_backend=...)`` (:meth:`Target.engine`), the transformers and peft baselines run on
the same device in the same dtype (:meth:`Target.hf_model`). CUDA runs its kernels
asynchronously, so every clock read around device work first waits for the device
(:meth:`Target.sync`, ``torch.cuda.synchronize``); peak memory is
``torch.cuda.max_memory_allocated`` (allocated tensors, not the caching allocator's
reserve), reset before each measured run. This module also holds the timing helpers
(:meth:`Target.sync`) those clocks need.

A ``--device cuda`` run on a machine without CUDA stops at argument parsing, with the reason:
no bench silently measures the CPU when a GPU was asked for.
"""

from __future__ import annotations

import argparse
import gc
import platform
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.engine.models.dtypes import DTYPES


@dataclass(frozen=True)
class Target:
    """Where and how a bench runs its engines and baselines.

    Attributes:
        device: ``cpu`` or ``cuda`` (the current CUDA device).
        dtype: Weights, activations and KV cache: ``float32``, ``bfloat16`` or ``float16``
            (an ``EngineConfig.dtype`` name).
        attention_backend: The engine's paged attention (and LoRA) kernels: ``torch`` or
            ``triton``.
    """

    device: torch.device
    dtype: str
    attention_backend: str = "torch"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The ``torch.dtype`` of :attr:`dtype`."""
        return DTYPES[self.dtype]

    @property
    def is_cuda(self) -> bool:
        """Whether the device is CUDA."""
        return self.device.type == "cuda"

    def engine(self) -> dict[str, str]:
        """The ``EngineConfig`` fields of this target."""
        return {
            "device": self.device.type,
            "dtype": self.dtype,
            "attention_backend": self.attention_backend,
        }

    def hf_model(self, path: Any) -> Any:
        """The baselines' model: ``AutoModelForCausalLM`` of ``path``, here, in eval mode.

        Loaded in this dtype, then moved to this device.
        """
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.torch_dtype)
        return model.to(self.device).eval()

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA); nothing on CPU."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        """Start a new peak-memory window (CUDA); nothing on CPU."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        """GiB of tensors allocated at the peak since :meth:`reset_peak`; None on CPU."""
        if not self.is_cuda:
            return None
        return round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)

    def release(self) -> None:
        """Free what dropped engines and models held, for the next one built in the process.

        Collects their reference cycles, then empties CUDA's caching allocator.
        """
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()

    def name(self) -> str:
        """The device's name (a GPU's model, else the CPU's)."""
        if self.is_cuda:
            return torch.cuda.get_device_name(self.device)
        return platform.processor() or "cpu"

    def describe(self) -> str:
        """One line for a bench's header."""
        return f"device {self.name()} ({self.device.type}), {self.dtype}, {self.attention_backend}"

    def figures(self) -> dict[str, str]:
        """The JSON-line fields naming the target."""
        return {
            "device": self.device.type,
            "device_name": self.name(),
            "dtype": self.dtype,
            "attention_backend": self.attention_backend,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--device``, ``--dtype`` and ``--attention-backend`` to a bench's parser."""
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the engine and the baselines run (default cpu); cuda also picks the "
        "GPU-sized workload",
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="weights, activations and KV cache (default: float32 on cpu, bfloat16 on cuda)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=["torch", "triton"],
        default="torch",
        help="the engine's paged attention and LoRA kernels (default torch)",
    )


def target_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Target:
    """The :class:`Target` the parsed options name.

    Raises:
        SystemExit: (``parser.error``, exit status 2) ``--device cuda`` where torch sees no
            CUDA device.
    """
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device cuda: torch {torch.__version__} sees no CUDA device "
            f"(torch.version.cuda={torch.version.cuda}); run on a GPU machine or use --device cpu"
        )
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return Target(torch.device(args.device), dtype, args.attention_backend)
