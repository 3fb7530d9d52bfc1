"""Runs inside vLLM's engine (`--worker-extension-cls specdraft_reload.DrafterReload`, this folder on its PYTHONPATH),
never imported by the project: vLLM and its torch only.

`reload_drafter(folder)` loads the drafter weights of an engine-ready export folder into the running engine, in place,
through vLLM's own in-place reload (vllm.model_executor.model_loader.reload: each layer restored, loaded, then
processed again, which on CPU re-packs the GEMM weights that loading had packed and emptied). Only the drafter's own
tensors are read: what the drafter shares with the verifier (the embedding, the LM head where it has none) is left
as it is. specdraft_record.py's POST /specdraft/reload_drafter calls it through vLLM's collective_rpc.
"""

from __future__ import annotations

import glob
import os
from typing import Any


class DrafterReload:
    """Mixed into vLLM's worker class by vLLM (its worker_extension_cls)."""

    def reload_drafter(self, folder: str) -> dict[str, Any]:
        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        runner = self.model_runner  # type: ignore[attr-defined]
        drafter = getattr(runner, "drafter", None)
        model = getattr(drafter, "model", None)
        if model is None:
            raise RuntimeError("this server drafts with no drafter model: there is nothing to reload")
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise RuntimeError(f"{folder} holds no .safetensors file")
        weights: dict[str, Any] = {}
        for f in files:
            weights.update(load_file(f))
        own = {n for n, _ in model.named_parameters()}
        config = drafter._create_draft_vllm_config() if hasattr(drafter, "_create_draft_vllm_config") else \
            self.vllm_config  # type: ignore[attr-defined]
        with set_current_vllm_config(config):
            reload_weights(config, model, weights_iterator=iter(weights.items()), weights_path=None,
                           is_checkpoint_format=True)
        return {"tensors": len(weights), "parameters": len(own)}
