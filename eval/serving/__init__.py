"""The serving wing of `python -m eval`: the run's export in a real serving engine, on the run's own prompts, beside
our decoder's figures (`engine_peers=[vllm]`), and under load (`engine_concurrency=[...]`: the concurrency x K sweep
through vLLM's server, the schedule it derives and the batch cost model's prediction).

Four calls, each at its step of the run:

    settings(peers, tokens, ...)              # by eval.settings.parse, before anything is read: the keys' refusals
    serving = check(s.serving, export)        # by eval.setup.check, with the export the run read: its refusals
    serving = ready(run)                      # once the run holds its verifier and prompts, before decoding
    report = measure(serving, s, run, samples)  # after our decoder: engine_peers in report.json (None: no peer)

The wing reads nothing of its own: the export, the verifier and the prompt sets are the run's.

The modules: peers.py (vLLM at batch 1), sweep.py (the load sweep), prompt_lengths.py (its length groups),
batch_cost.py (the batch cost model), report.py (its table and plot). `python -m scripts.bench.serving_load` runs the
sweep alone through the same modules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from eval.serving.peers import check_peers, llamacpp_load, llamacpp_peer, openvino_peer, vllm_peer
from eval.serving.sweep import (
    LoadSettings,
    check_clients,
    load_settings,
    predictor,
    sweep,
    with_export,
    with_groups,
)
from runtime.errors import UserError


@dataclass(frozen=True)
class Serving:
    """What the run asks of the serving engines: the peers (empty: none), the K a peer drafts at batch 1 (None: the
    export's own) and the load sweep's settings (None: the peers at batch 1 only)."""

    peers: tuple[str, ...] = ()
    tokens: int | None = None
    load: LoadSettings | None = None


def settings(peers: list[str], tokens: object, concurrency: object, lengths: object, multi_turn: bool, method: str,
             checkpoint: str | None) -> Serving:
    """engine_peers, engine_peer_tokens, engine_concurrency and engine_prompt_lengths as the command line gave them,
    checked before anything loads (eval.serving.peers.check_peers, eval.serving.sweep.load_settings); called once, by
    eval.settings.parse, which holds the result as EvalSettings.serving."""
    checked = check_peers(peers, multi_turn, method)
    load = load_settings(concurrency, tokens, checked, checkpoint, lengths)
    if load is not None and checked not in (["vllm"], ["llamacpp"]):
        raise UserError(f"engine_concurrency with engine_peers={checked}: the load sweep runs in one engine, vLLM's "
                        f"server or llama.cpp's (its parallel slots); give engine_peers=[vllm] or [llamacpp] for the "
                        f"sweep, or leave engine_concurrency out for the peers at batch 1.")
    if load is not None and checked == ["llamacpp"] and (load.lengths or len(load.ks) > 1):
        raise UserError("engine_peers=[llamacpp] with engine_concurrency sweeps llama.cpp's fastest batch-1 setting "
                        "(K up to engine_peer_tokens, each confidence cut) over the concurrencies: give one K "
                        "(engine_peer_tokens=3) and no engine_prompt_lengths (vLLM's sweep splits by length).")
    return Serving(tuple(checked), tokens if isinstance(tokens, int) and load is None else None, load)


def check(serving: Serving, export: Any) -> Serving:
    """The sweep's settings against the export the run read (`export`: its ExportInfo, or None): a family vLLM does
    not serve, a K beyond what it drafts (eval.serving.sweep.with_export); called by eval.setup.check, the run's one
    check, before the verifier loads."""
    if serving.load is None:
        return serving
    if serving.peers == ("llamacpp",):  # llama.cpp's sweep: its own refusal, not vLLM's servable families
        from serve import gguf

        if (why := gguf.refusal(export.kind if export is not None else None)) is not None:
            raise UserError(f"engine_concurrency with engine_peers=[llamacpp]: {why}")
        return replace(serving, load=replace(serving.load, export=export))
    return replace(serving, load=with_export(serving.load, export))


def ready(run: Any) -> Serving:
    """The run's serving settings with the sweep's length groups drawn from the run's prompt pool as its verifier
    renders them, and as many prompts as clients checked, before the run decodes (`run`: eval.setup.Run, not
    imported here, as it imports this wing)."""
    s = run.settings
    source = s.prompts if isinstance(s.prompts, str) else "[" + ",".join(map(str, s.prompts)) + "]"
    load = with_groups(run.serving.load, run.pool, source, s.num_prompts, run.verifier)
    check_clients(load, len(run.convs))
    return replace(run.serving, load=load)


def measure(serving: Serving, s: Any, run: Any, samples: list[Any]) -> dict[str, Any] | None:
    """The run's prompts through each peer (the real vLLM, OpenVINO GenAI, llama.cpp), plain and with the export
    drafting: at batch 1 beside our decoder, or under load (vLLM); None when no peer was asked for."""
    from data.chat import prompt_ids
    from eval.runner import user_turns

    if not serving.peers:
        return None
    export = run.exports[0] if run.exports else None
    kind = export.kind if export is not None else None
    prompts = [prompt_ids(run.verifier.tokenizer, user_turns(c)[0], run.verifier.rendering) for c in run.convs]
    ours = [sample.outputs["baseline"] for sample in samples]
    if serving.load is not None and export is not None and serving.peers == ("llamacpp",):  # its parallel slots
        tokens = serving.load.ks[0] if serving.load.ks else (export.speculative_tokens or None)
        print(f"engine_peers: llama.cpp at batch 1, then by concurrency {list(serving.load.concurrency)}")
        peer = llamacpp_peer(run.verifier, kind, export, prompts, ours, s.max_new_tokens, s.dtype, s.threads,
                             s.sampling.temperature, s.sampling.top_p, s.seed, tokens, s.cache_dir)
        peer["by_concurrency"] = llamacpp_load(peer, serving.load.concurrency, prompts, s.max_new_tokens, s.threads,
                                               s.sampling.temperature, s.seed)
        return {"llamacpp": peer}
    if serving.load is not None and export is not None:  # engine_concurrency: the sweep in vLLM's server
        return {"vllm": sweep(serving.load, run.verifier, prompts, s.max_new_tokens, s.dtype, s.threads,
                              s.sampling.temperature, s.seed, s.output_dir, s.cache_dir, predictor(run, prompts[0]))}
    tokens = serving.tokens or (export.speculative_tokens if export is not None else None)
    drivers = {"vllm": vllm_peer, "openvino": openvino_peer, "llamacpp": llamacpp_peer}
    report = {}
    for peer in serving.peers:
        print(f"engine_peers: {peer} plain and {kind or 'no drafter'} on {len(prompts)} prompts")
        report[peer] = drivers[peer](run.verifier, kind, export, prompts, ours, s.max_new_tokens, s.dtype, s.threads,
                                     s.sampling.temperature, s.sampling.top_p, s.seed, tokens, s.cache_dir)
    return report
