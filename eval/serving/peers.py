"""Serving engines as peers in `python -m eval ... engine_peers=[vllm]`: the same prompts through the real vLLM,
plain and with the export drafting, beside our own decoder's figures in the same run. The question it answers is
"what will this drafter do in my server": tokens/s, per-position acceptance, tau and speedup as vLLM measures them.

vLLM runs in its own virtualenv (serve/vllm_engine.py), one process per configuration, batch 1, timed from its
first request after a warm-up request (model load excluded), with Intel OpenMP preloaded as its CPU guide asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from models.families import FAMILIES
from models.verifiers.core import Verifier
from runtime.errors import UserError

PEERS = ("vllm",)
DEFAULT_TOKENS = 3


def check_peers(peers: Sequence[str], multi_turn: bool, method: str) -> list[str]:
    """engine_peers as a list of known names, refusing what the peer run cannot measure."""
    peers = [str(p) for p in peers or []]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise UserError(f"engine_peers={peers}: {unknown} unknown; the engines this harness drives are {list(PEERS)}.")
    if peers and multi_turn:
        raise UserError("engine_peers with multi_turn=true: the peers answer single turns only (their histories would "
                        "be their own answers, not ours); drop one of the two.")
    if peers and method == "all":
        raise UserError("engine_peers with method=all: run the peers on one export (method=single).")
    return peers


def vllm_peer(verifier: Verifier, kind: str | None, export: Any | None, prompts: list[list[int]],
              ours: list[list[int]], max_new_tokens: int, dtype: str, threads: int, temperature: float,
              top_p: float, seed: int, tokens: int | None = None, cache_dir: str | None = None) -> dict[str, Any]:
    """vLLM plain and (for a family vLLM serves) with the export drafting `tokens` per step, on `prompts` (a compact
    shipped export written back in full first: serve.server.served_folder). `ours`: our plain decoding's outputs on
    the same prompts, for the greedy agreement. `export`: the run's ExportInfo (models.exports.io), or None."""
    from serve import vllm_engine
    from serve.server import served_folder

    if not verifier.checkpoint:
        raise UserError(f"engine_peers=[vllm]: the verifier {verifier.name} was built in memory and vLLM loads "
                        f"from a directory; save it with models.verifiers.hf.save_checkpoint, or use a "
                        f"checkpoint verifier.")
    tokens = int(tokens or DEFAULT_TOKENS)
    common = dict(dtype=dtype, threads=threads, temperature=temperature, top_p=top_p, seed=seed,
                  max_model_len=max(len(p) for p in prompts) + max_new_tokens + tokens + 8)
    plain = vllm_engine.serve(verifier.checkpoint, prompts, max_new_tokens, **common)
    out: dict[str, Any] = {
        "version": plain.version, "setup": plain.setup | {"batch": 1, "timing": "generate() per prompt after one "
                                                          "warm-up request; model load excluded"},
        "plain": {"tokens_per_s": plain.tokens / plain.seconds if plain.seconds else 0.0,
                  "tokens": plain.tokens, "seconds": plain.seconds, "load_seconds": plain.load_seconds},
        "greedy_match_ours": (sum(a == b for a, b in zip(plain.outputs, ours)) / len(ours)
                              if temperature == 0 and ours else None),
        "speculative": None,
    }
    refusal = FAMILIES[kind].serve_cpu_refusal if kind in FAMILIES else None
    if kind in vllm_engine.methods() and export is not None and refusal is None:
        served = served_folder(export.path, export.config, verifier, cache_dir)
        spec = vllm_engine.serve(verifier.checkpoint, prompts, max_new_tokens,
                                 spec=vllm_engine.speculative_config(kind, served, tokens), **common)
        tps = spec.tokens / spec.seconds if spec.seconds else 0.0
        out["speculative"] = {"method": kind, "speculative_tokens": tokens, "tokens_per_s": tps,
                              "tokens": spec.tokens, "seconds": spec.seconds, "tau": spec.tau,
                              "accept_rate_per_position": spec.alpha, "counts": spec.spec,
                              "speedup": tps / out["plain"]["tokens_per_s"] if out["plain"]["tokens_per_s"] else None,
                              "load_seconds": spec.load_seconds}
    elif refusal is not None:
        out["note"] = f"vLLM {plain.version}'s CPU build does not serve {kind}: {refusal}; plain decoding only"
    else:
        out["note"] = f"vLLM {plain.version} does not serve {kind or 'this drafter'}: plain decoding only"
    return out
