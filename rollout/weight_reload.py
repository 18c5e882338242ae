"""vLLM worker extension that loads pushed weights in place.

vLLM imports this class into each of its workers (`worker_extension_cls`); the engine
calls its methods through `collective_rpc`. Tensors cannot travel as rpc arguments (they
arrive as lists), so weights come as safetensors bytes or a folder path.
"""

from __future__ import annotations

import hashlib
from typing import Any


def checksum_tensors(named: dict[str, Any], names: list[str]) -> str:
    """sha256 over the raw bytes of the named tensors (fp32 view), in the given order.

    The trainer computes the same digest over the weights it pushed; a mismatch means an
    engine serves different weights than the trainer believes.
    """
    digest = hashlib.sha256()
    for name in names:
        tensor = named[name].detach().to("cpu").contiguous().float()
        digest.update(name.encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


class WeightReloadExtension:
    """Methods mixed into vLLM's worker; `self.model_runner` is the worker's runner."""

    def sluice_load_weights(self, blob: bytes | None = None, path: str | None = None) -> None:
        if (blob is None) == (path is None):
            raise ValueError("pass exactly one of blob (safetensors bytes) or path (a folder)")
        if path is not None:
            self.model_runner.reload_weights(weights_path=path)  # type: ignore[attr-defined]
            return
        from safetensors.torch import load

        state = load(blob)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))  # type: ignore[attr-defined]

    def sluice_checksum(self, names: list[str]) -> str:
        """Digest of the served parameters `names` (vLLM's own, possibly fused, names)."""
        params = dict(self.model_runner.get_model().named_parameters())  # type: ignore[attr-defined]
        missing = [n for n in names if n not in params]
        if missing:
            raise KeyError(f"engine has no parameters {missing}")
        return checksum_tensors(params, names)
