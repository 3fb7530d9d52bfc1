"""Runs inside the vLLM virtualenv (scripts/setup_vllm.sh), never imported by the project: it reads a JSON
request, generates with vLLM's offline `LLM`, and writes a JSON result. serve/vllm_engine.py is its only caller.

    $SPECDRAFT_VLLM_VENV/bin/python serve/vllm_worker.py request.json result.json   # one request
    $SPECDRAFT_VLLM_VENV/bin/python serve/vllm_worker.py --loop                      # one per stdin line

With --loop it stays up (vLLM imported once, ~8 s of every start on a 2-core CPU) and serves one request per stdin
line `{"request": PATH, "result": PATH}`, each with an engine of its own that it shuts down before the next; a request
that fails writes `{"error": traceback}` as its result and ends the process, so no half-started engine is reused.

Request: {"model", "dtype", "speculative_config" (or null), "prompts" (token id lists), "max_tokens",
"temperature", "top_p", "seed", "max_model_len", "gpu_memory_utilization", "enforce_eager", "warmup", "batch"}:
"batch" true hands every prompt to vLLM at once (offline batched generation, for data building), else one request
after another (batch 1, the latency a single user sees).
Result: {"vllm_version", "outputs" (token id lists), "seconds" (generation wall time), "load_seconds",
"spec" ({"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"} as vLLM counts them, or
null), "speculative_config" (what vLLM resolved, for a speculators-format model served as it is), "setup"}.
Standard library and vLLM only: this file runs under another interpreter than the project's.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

SPEC_METRICS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counts(llm) -> dict | None:
    """vLLM's own speculative-decoding counters (summed over its engines), or None when it drafted nothing."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    seen = False
    for m in llm.get_metrics():
        if m.name in SPEC_METRICS:
            out[SPEC_METRICS[m.name]] += int(m.value)
            seen = True
        elif m.name == PER_POS:
            values = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * len(values), values)] if acc else values
            seen = True
    return out if seen else None


def serve(req: dict) -> dict:
    """One request: an engine started for it, its generations and counters, the engine shut down."""
    from vllm import LLM

    kwargs = dict(model=req["model"], dtype=req.get("dtype", "bfloat16"), seed=int(req.get("seed", 0)),
                  max_model_len=int(req.get("max_model_len", 2048)),
                  gpu_memory_utilization=float(req.get("gpu_memory_utilization", 0.35)),
                  enforce_eager=bool(req.get("enforce_eager", True)), disable_log_stats=False)
    if req.get("speculative_config"):
        kwargs["speculative_config"] = req["speculative_config"]
    start = time.perf_counter()
    llm = LLM(**kwargs)
    try:
        return generate(llm, req, kwargs, time.perf_counter() - start)
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):  # its engine-core process, where vLLM started one
            core.shutdown()


def release() -> None:
    """What the last engine held (its memory, vLLM's process-wide parallel state) freed for the next one."""
    gc.collect()
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def write(result: dict, result_file: str) -> None:
    tmp = result_file + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, result_file)


def loop() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        try:
            result = serve(json.loads(open(job["request"], encoding="utf-8").read()))
        except Exception:
            sys.stdout.flush()
            write({"error": traceback.format_exc()}, job["result"])
            sys.exit(1)
        release()
        sys.stdout.flush()
        sys.stderr.flush()
        write(result, job["result"])


def generate(llm, req: dict, kwargs: dict, load_seconds: float) -> dict:
    from vllm import SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=float(req.get("temperature", 0.0)), top_p=float(req.get("top_p", 1.0)),
                            max_tokens=int(req["max_tokens"]), seed=int(req.get("seed", 0)), ignore_eos=False)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
    if req.get("warmup"):  # one short request first: kernels and caches warm, as a server's would be
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    before = spec_counts(llm)
    outputs, seconds = [], 0.0
    groups = [prompts] if req.get("batch") else [[p] for p in prompts]
    for group in groups:
        start = time.perf_counter()
        outs = llm.generate(group, params, use_tqdm=bool(req.get("batch")))
        seconds += time.perf_counter() - start
        outputs += [list(o.outputs[0].token_ids) for o in outs]
    after = spec_counts(llm)
    spec = None
    if after is not None:
        b = before or {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
        spec = {k: after[k] - b[k] for k in SPEC_METRICS.values()}
        prev = b["accepted_per_pos"] + [0] * len(after["accepted_per_pos"])
        spec["accepted_per_pos"] = [a - prev[i] for i, a in enumerate(after["accepted_per_pos"])]
    resolved = getattr(llm.llm_engine.vllm_config, "speculative_config", None)
    return {
        "vllm_version": __version__, "outputs": outputs, "seconds": seconds, "load_seconds": load_seconds,
        "spec": spec,
        "speculative_config": None if resolved is None else {
            "method": getattr(resolved, "method", None),
            "num_speculative_tokens": getattr(resolved, "num_speculative_tokens", None),
            "model": getattr(getattr(resolved, "draft_model_config", None), "model", None),
            **({"parallel_drafting": True} if getattr(resolved, "parallel_drafting", False) else {})},
        "served_model": llm.llm_engine.vllm_config.model_config.model,
        "setup": {"dtype": kwargs["dtype"], "enforce_eager": kwargs["enforce_eager"],
                  "threads": os.environ.get("OMP_NUM_THREADS"), "ld_preload": os.environ.get("LD_PRELOAD", ""),
                  "kv_cache_space": os.environ.get("VLLM_CPU_KVCACHE_SPACE"), "worker_pid": os.getpid()},
    }


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the guard is required
    if sys.argv[1:] == ["--loop"]:
        loop()
    else:
        write(serve(json.loads(open(sys.argv[1], encoding="utf-8").read())), sys.argv[2])
