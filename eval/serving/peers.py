"""Serving engines as peers in `python -m eval ... engine_peers=[vllm,openvino,llamacpp]`: the same prompts through
the real vLLM, OpenVINO GenAI and llama.cpp, plain and with the export drafting, beside our own decoder's figures in
the same run. The question it answers is "what will this drafter do in my server": tokens/s, acceptance, tau and
speedup as the engine measures them, against the engine's own plain decoding.

vLLM runs in its own virtualenv (serve/vllm_engine.py), one process per configuration, batch 1, timed from its
first request after a warm-up request (model load excluded), with Intel OpenMP preloaded as its CPU guide asks.
OpenVINO GenAI runs in its own (serve/openvino_engine.py): the export converted once (cached), then plain, drafting
and its own prompt lookup in one process, interleaved prompt by prompt, each after one warm-up request.
llama.cpp runs from its own (serve/llamacpp_engine.py): the export converted to GGUF once (cached, where `python -m
serve EXPORT --engine llamacpp` finds it), then one llama-server per configuration, one at a time (plain; each K
from 1 up at each confidence cut; plain again, so the drift between the two plain passes is reported), each after one
warm-up request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from models.families import FAMILIES
from models.verifiers.core import Verifier
from runtime.errors import UserError

PEERS = ("vllm", "openvino", "llamacpp")
CUTS = (0.0, 0.6)  # llama.cpp's --spec-draft-p-min: never cut, and the cut docs/results/llamacpp.md found best
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


def _agreement(outputs: list[list[int]], other: list[list[int]] | None, temperature: float) -> float | None:
    """The fraction of prompts whose greedy outputs are equal (None when sampling, or nothing to compare)."""
    if temperature != 0 or not other:
        return None
    return sum(a == b for a, b in zip(outputs, other)) / len(other)


def openvino_peer(verifier: Verifier, kind: str | None, export: Any | None, prompts: list[list[int]],
                  ours: list[list[int]], max_new_tokens: int, dtype: str, threads: int, temperature: float,
                  top_p: float, seed: int, tokens: int | None = None, cache_dir: str | None = None) -> dict[str, Any]:
    """OpenVINO GenAI plain, drafting `tokens` per step with the export (a family it drafts with: EAGLE-3), and its
    own prompt lookup proposing as many, on `prompts` (serve.openvino_engine; the export converted once under
    <cache>/openvino). Speedups are over OpenVINO's own plain decoding; agreement is with OpenVINO's plain output
    and with `ours` (our plain decoding's outputs). OpenVINO exposes accepted and offered draft tokens and its main
    model's inferences, not acceptance per position: the acceptance reported is accepted per round and tau."""
    from serve import openvino_engine as ov

    if not verifier.checkpoint:
        raise UserError(f"engine_peers=[openvino]: the verifier {verifier.name} was built in memory and optimum-intel "
                        f"converts from a directory; save it with models.verifiers.hf.save_checkpoint, or use a "
                        f"checkpoint verifier.")
    tokens = int(tokens or DEFAULT_TOKENS)
    drafting = kind in ov.modes() and export is not None
    if drafting:
        folder = ov.converted_folder(export.path, verifier.checkpoint, cache_dir)
        model = folder / "verifier"
    else:
        model = ov.converted_verifier(verifier.checkpoint, cache_dir)
    configs = [ov.configuration("plain")]
    if drafting:
        configs.append(ov.configuration("speculative", folder / "draft", tokens))
    configs.append(ov.configuration("prompt_lookup", tokens=tokens, lookup=True))
    runs = ov.serve_many(model, prompts, max_new_tokens, configs, precision=dtype, threads=threads,
                         temperature=temperature, top_p=top_p, seed=seed)
    plain = runs["plain"]

    def row(run: Any, method: str) -> dict[str, Any]:
        return {"method": method, "speculative_tokens": tokens, "tokens_per_s": run.tokens_per_s, "tokens": run.tokens,
                "seconds": run.seconds, "load_seconds": run.load_seconds, "tau": run.tau,
                "accept_rate_per_position": [], "accepted_per_round": run.accepted_per_round,
                "acceptance_rate": run.acceptance_rate,
                "counts": {"accepted": run.accepted, "draft_tokens": run.draft_tokens, "rounds": run.rounds},
                "speedup": run.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else None,
                "greedy_match_plain": _agreement(run.outputs, plain.outputs, temperature),
                "greedy_match_ours": _agreement(run.outputs, ours, temperature)}

    out: dict[str, Any] = {
        "version": plain.version,
        "setup": {"batch": 1, "precision": ov.PRECISIONS.get(dtype, dtype), "threads": threads,
                  "timing": "generate() per prompt, configurations interleaved prompt by prompt, after one warm-up "
                            "request each; conversion and load excluded"},
        "plain": {"tokens_per_s": plain.tokens_per_s, "tokens": plain.tokens, "seconds": plain.seconds,
                  "load_seconds": plain.load_seconds},
        "greedy_match_ours": _agreement(plain.outputs, ours, temperature),
        "speculative": row(runs["speculative"], kind or "") if drafting else None,
        "prompt_lookup": row(runs["prompt_lookup"], "prompt_lookup"),
    }
    if not drafting:
        out["note"] = (f"OpenVINO GenAI {plain.version} does not draft with {kind or 'this drafter'}: plain decoding "
                       f"and its prompt lookup only")
    return out


def llamacpp_peer(verifier: Verifier, kind: str | None, export: Any | None, prompts: list[list[int]],
                  ours: list[list[int]], max_new_tokens: int, dtype: str, threads: int, temperature: float,
                  top_p: float, seed: int, tokens: int | None = None, cache_dir: str | None = None) -> dict[str, Any]:
    """llama.cpp plain and, for a family it drafts with (EAGLE-3, DFlash, DSpark), drafting K = 1..`tokens` tokens a
    step at each confidence cut of CUTS, on `prompts`, the verifier as a GGUF in the run's dtype (bf16, f32), the
    export converted once into the cache (serve.llamacpp_serve.converted_folder). Speedups are over llama.cpp's own
    plain decoding; acceptance per position and tau as llama.cpp counts them; agreement with its plain output and
    with `ours`. The fastest drafting configuration is `speculative`, every one is in `configurations`, and its K and
    cut are written to the conversion's launch.json, which `python -m serve EXPORT --engine llamacpp` launches with.
    `top_p` is llama.cpp's default (the peer sends temperature and seed only)."""
    import json

    from serve import gguf, llamacpp_engine
    from serve.llamacpp_serve import converted_folder

    if export is None:
        raise UserError("engine_peers=[llamacpp] needs checkpoint=<export>: llama.cpp is given the verifier the "
                        "export names, as GGUF.")
    quant = {"bfloat16": "bf16", "float32": "f32"}.get(str(verifier.model.dtype).removeprefix("torch."))
    if quant is None:
        raise UserError(f"engine_peers=[llamacpp]: the verifier runs in {verifier.model.dtype}; llama.cpp's peer "
                        f"runs it as a bf16 or f32 GGUF: give dtype=bfloat16 or dtype=float32.")
    refusal = gguf.refusal(kind)
    folder = converted_folder(export.path, quant, refusal is not None, cache_dir)
    manifest = json.loads((folder / gguf.MANIFEST).read_text())
    model = folder / manifest["verifier"]["files"][quant]
    tokens = int(tokens or DEFAULT_TOKENS)
    configs = {"plain": llamacpp_engine.ServerSettings(model, threads=threads)}
    if refusal is None:
        for k in range(1, tokens + 1):
            for cut in CUTS:
                configs[f"K={k} p-min={cut}"] = llamacpp_engine.ServerSettings(
                    model, folder / manifest["draft"], manifest["kind"], k, cut, threads)
    configs["plain again"] = llamacpp_engine.ServerSettings(model, threads=threads)
    runs = llamacpp_engine.serve_many(configs, prompts, max_new_tokens, temperature, seed)
    plain, again = runs.pop("plain"), runs.pop("plain again")
    plain_seconds = (plain.seconds + again.seconds) / 2  # the drafting passes ran between the two
    plain_rate = plain.tokens / plain_seconds if plain_seconds else 0.0

    def row(name: str, run: Any) -> dict[str, Any]:
        settings = configs[name]
        return {"method": kind, "speculative_tokens": settings.tokens, "p_min": settings.p_min,
                "tokens_per_s": run.tokens_per_second, "tokens": run.tokens, "seconds": run.seconds, "tau": run.tau,
                "accept_rate_per_position": run.alpha,
                "counts": {"drafted": run.drafted, "accepted": run.accepted, "steps": run.steps,
                           "accepted_per_position": run.accepted_per_pos},
                "speedup": run.tokens_per_second / plain_rate if plain_rate else None,
                "greedy_match_plain": _agreement(run.outputs, plain.outputs, temperature),
                "greedy_match_ours": _agreement(run.outputs, ours, temperature)}

    rows = [row(name, run) for name, run in runs.items()]
    out: dict[str, Any] = {
        "version": f"b{llamacpp_engine.VERSION.split('.')[0]}", "quant": quant, "folder": str(folder),
        "setup": {"batch": 1, "threads": threads, "timing": "llama-server's own predicted_ms per request, one "
                  "server at a time (plain first and last, averaged), after one warm-up request each; conversion "
                  "and load excluded"},
        "plain": {"tokens_per_s": plain_rate, "tokens": plain.tokens, "seconds": plain_seconds,
                  "drift": again.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else None},
        "greedy_match_ours": _agreement(plain.outputs, ours, temperature),
        "speculative": max(rows, key=lambda r: r["tokens_per_s"]) if rows else None,
        "configurations": rows,
    }
    if refusal is not None:
        out["note"] = f"plain decoding only: {refusal}"
    else:
        best = out["speculative"]
        launch = {"tokens": best["speculative_tokens"], "p_min": best["p_min"],
                  "measured": {"speedup": best["speedup"], "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                               "threads": threads}}
        (folder / gguf.LAUNCH).write_text(json.dumps(launch, indent=1))
        out["launch"] = str(folder / gguf.LAUNCH)
    return out


def llamacpp_load(peer: dict[str, Any], levels: Sequence[int], prompts: list[list[int]], max_new_tokens: int,
                  threads: int, temperature: float, seed: int) -> list[dict[str, Any]]:
    """llama.cpp by concurrency (its parallel slots): for each level, plain and the batch-1 peer's fastest drafting
    configuration (`peer`: what llamacpp_peer returned), each on a server with that many slots and as many closed-loop
    clients (serve.llamacpp_engine.serve_concurrent); output tokens/s over the wall time and the speedup of drafting
    over plain at that concurrency."""
    import json
    from pathlib import Path

    from serve import gguf, llamacpp_engine

    folder = Path(peer["folder"])
    manifest = json.loads((folder / gguf.MANIFEST).read_text())
    model = folder / manifest["verifier"]["files"][peer["quant"]]
    best = peer.get("speculative")
    rows = []
    for c in sorted(levels):
        plain = llamacpp_engine.serve_concurrent(llamacpp_engine.ServerSettings(model, threads=threads), prompts,
                                                 max_new_tokens, c, temperature, seed)
        row: dict[str, Any] = {"concurrency": c, "slots": plain["slots"], "plain_tokens_per_s": plain["tokens_per_s"],
                               "plain_per_request_tokens_per_s": plain["per_request_tokens_per_s"]}
        if best is not None:
            spec = llamacpp_engine.serve_concurrent(llamacpp_engine.ServerSettings(
                model, folder / manifest["draft"], manifest["kind"], best["speculative_tokens"], best["p_min"],
                threads), prompts, max_new_tokens, c, temperature, seed)
            row |= {"speculative_tokens": best["speculative_tokens"], "p_min": best["p_min"],
                    "speculative_tokens_per_s": spec["tokens_per_s"],
                    "speculative_per_request_tokens_per_s": spec["per_request_tokens_per_s"],
                    "accepted": spec["accepted"], "drafted": spec["drafted"],
                    "speedup": spec["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else None}
        rows.append(row)
    return rows
