"""What a drafter is worth under load: the run's prompts through vLLM's OpenAI-compatible server (serve/server.py,
loopback only) at several concurrencies, plain and with the export drafting each K, then the K per batch size that
gives the most output tokens/s written as vLLM's own `num_speculative_tokens_per_batch_size` and measured once more.

    python -m eval checkpoint=pretrained/eagle3-smollm2 engine_peers=[vllm] engine_concurrency=[1,2,4,8,16] \\
        engine_peer_tokens=[1,2,3,5] num_prompts=16 max_new_tokens=64

One server per setting (plain, each K, the schedule), `max_num_seqs` = the largest concurrency; after a warm-up
request, each concurrency is a closed loop (serve/client.py): that many clients, each sending its next prompt when
its answer is complete, until the prompts run out. vLLM's speculative counters are read from /metrics before and
after each pass. report.json `engine_peers.vllm`: `by_concurrency` (per concurrency: plain and per K output tokens/s,
per-request tokens/s and time to first token (median, p90), speedup, acceptance length and per position),
`schedule` (K per batch-size range, K = 0 where no K pays, and `scheduled_speedup` per concurrency), `prediction`
(eval/batch_cost.py: the best K per batch size and the crossover predicted from this machine's verify costs and the
export's acceptance, beside the measured ones). A setting vLLM refuses is named in `errors` and the sweep goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import UserError

PORT = 18400  # loopback port of the sweep's servers (a free one is looked for from here)


@dataclass(frozen=True)
class LoadSettings:
    """engine_concurrency and engine_peer_tokens as the sweep takes them, checked at the door."""

    concurrency: tuple[int, ...]
    ks: tuple[int, ...]


def _whole_list(value: Any, key: str) -> list[Any]:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return list(value) if isinstance(value, list | tuple) else [value]


def load_settings(concurrency: Any, tokens: Any, peers: Sequence[str], export: str | None) -> LoadSettings | None:
    """engine_concurrency (None or [] : no sweep) and engine_peer_tokens, refused before anything loads: a
    concurrency of 0 or below, engine_concurrency without engine_peers, a K that is not whole, below 1 or beyond
    what the export drafts; several K without engine_concurrency."""
    from serve.server import check_tokens, read_export

    ks_given = None if tokens is None else _whole_list(tokens, "engine_peer_tokens")
    if concurrency is None or _whole_list(concurrency, "engine_concurrency") == []:
        if ks_given is not None and not isinstance(tokens, int):
            raise UserError(f"engine_peer_tokens={ks_given}: a list of K is swept under load only; add "
                            f"engine_concurrency=[1,2,4,...], or give one K (engine_peer_tokens=3).")
        return None
    levels = _whole_list(concurrency, "engine_concurrency")
    for c in levels:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise UserError(f"engine_concurrency={levels}: {c!r} is not a number of clients; give whole numbers "
                            f">= 1, e.g. engine_concurrency=[1,2,4,8,16].")
    if not peers:
        raise UserError(f"engine_concurrency={levels} without engine_peers: the sweep runs in a serving engine; add "
                        f"engine_peers=[vllm].")
    if export is None:
        raise UserError(f"engine_concurrency={levels}: the sweep measures an export's drafter under load; give "
                        f"checkpoint=<export dir>.")
    info = read_export(export)
    ks = ks_given if ks_given is not None else [info.speculative_tokens or 3]
    check_tokens(ks, info.config, info.path, "engine_peer_tokens")
    return LoadSettings(tuple(sorted(set(levels))), tuple(sorted(set(ks))))


def predictor(run: Any, prefix: list[int]) -> Callable[[list[int], list[int]], Any]:
    """The batch cost model for a `python -m eval` run (its Setup): its verifier and export, and the drafter's
    batch-1 draft curve where the run measured one (tree.size=auto)."""
    sizes = run.curves[0].sizes if run.curves and run.draft_curve else None
    return batch_predictor(run.verifier.model, run.exports[0].acceptance, prefix, sizes, run.draft_curve)


def batch_predictor(model: Any, acceptance: Any, prefix: list[int], sizes: Sequence[int] | None = None,
                    draft_curve: Sequence[float] | None = None) -> Callable[[list[int], list[int]], Any]:
    """The batch cost model (eval/batch_cost.py): verify costs of `model` measured when called, on the prefix
    `prefix`, the export's acceptance table, the draft curve (ms at `sizes` nodes) or no draft cost."""

    def predict(levels: list[int], ks: list[int]) -> Any:
        import torch

        from eval.batch_cost import draft_ms_per_k, predict, verify_costs

        print(f"[load] the batch cost model: verify costs at batch sizes {levels}, widths K + 1", flush=True)
        costs = verify_costs(model, torch.tensor([prefix]), levels, sorted({1, *(k + 1 for k in ks)}))
        return predict(costs, levels, ks, acceptance, draft_ms_per_k(sizes, draft_curve, ks))

    return predict


def schedule_of(rows: Sequence[dict[str, Any]], most: int) -> tuple[tuple[int, int, int], ...]:
    """The K per batch-size range that gave the most output tokens/s: batch sizes above the previous measured
    concurrency up to this one take its best K (0 where no K beat plain), the last range reaching `most`;
    neighbouring ranges of one K merged."""
    ranges: list[list[int]] = []
    low = 1
    for i, row in enumerate(rows):
        high = most if i == len(rows) - 1 else row["concurrency"]
        k = row["best_k"]
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = high
        else:
            ranges.append([low, high, k])
        low = high + 1
    return tuple((a, b, k) for a, b, k in ranges)


def _free_port(start: int) -> int:
    import socket

    for port in range(start, start + 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise UserError(f"no free loopback port in {start}..{start + 199} for the sweep's vLLM server.")


def _spec_row(k: int, passed: Any, counts: dict[str, Any] | None, plain: dict[str, Any],
              plain_outputs: list[list[int]]) -> dict[str, Any]:
    s = passed.summary()
    counts = counts or {"num_drafts": 0}
    drafts = counts.get("num_drafts") or 0
    return {"k": k, "tokens_per_s": s["tokens_per_s"],
            "speedup": s["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else None,
            "per_request_tokens_per_s": s["per_request_tokens_per_s"], "ttft_s": s["ttft_s"],
            "acceptance_length": 1 + counts["num_accepted_tokens"] / drafts if drafts else None,
            "acceptance_per_position": [a / drafts for a in counts["accepted_per_pos"]] if drafts else [],
            "counts": counts, "tokens": s["tokens"], "seconds": s["seconds"],
            "greedy_match_plain": sum(a == b for a, b in zip(passed.outputs, plain_outputs)) / len(plain_outputs)}


def _serve_passes(settings: Any, label: str, prompts: list[list[int]], max_tokens: int, levels: Sequence[int],
                  temperature: float, seed: int, log_dir: Path
                  ) -> tuple[dict[int, tuple[Any, dict[str, Any] | None]], str | None]:
    """One server, every concurrency: (the pass, the counters it added) per concurrency, and the cause vLLM's log
    names where it failed a pass (the passes before it are kept)."""
    import httpx

    from serve.client import run_pass
    from serve.server import Server, counter_delta, log_cause, spec_counters

    out = {}
    server = Server(settings, log=log_dir / f"vllm-{label.replace('=', '')}.log")
    with server:
        try:
            run_pass(settings.url, settings.name, prompts[:1], 4, 1)  # warm-up: kernels, caches
            for c in levels:
                before = spec_counters(settings.url)
                passed = run_pass(settings.url, settings.name, prompts, max_tokens, c, temperature, seed)
                out[c] = (passed, counter_delta(before, spec_counters(settings.url)))
                print(f"[load] {label}, concurrency {c}: {passed.summary()['tokens_per_s']:.1f} tok/s", flush=True)
        except (RuntimeError, httpx.HTTPError) as e:
            time.sleep(2)  # the engine's traceback reaches the log
            assert server.log is not None
            return out, f"{log_cause(server.log.read_text(errors='replace'))} (client: {str(e)[:200]})"
    return out, None


def sweep(load: LoadSettings, export: str, prompts: list[list[int]], max_new_tokens: int, dtype: str,
          threads: int | None, temperature: float, seed: int, out_dir: Path,
          cache_dir: str | None = None, predict: Any = None) -> dict[str, Any]:
    """The whole sweep (module docstring); `predict(levels, ks)`: the batch cost model's Prediction, or None."""
    from serve import vllm_engine
    from serve.server import ServeSettings, format_schedule, prepare, read_export, served_name

    info = read_export(export)
    verifier, served = prepare(info, cache_dir)
    most = max(load.concurrency)
    base: dict[str, Any] = dict(max_num_seqs=most, dtype=dtype, threads=threads, name=served_name(info.path),
                                port=_free_port(PORT),
                                max_model_len=max(len(p) for p in prompts) + max_new_tokens + max(load.ks) + 16)
    log_dir = out_dir / "vllm_load"
    log_dir.mkdir(parents=True, exist_ok=True)
    errors: list[dict[str, Any]] = []

    def run(settings: Any, what: str) -> dict[int, tuple[Any, dict[str, Any] | None]] | None:
        try:
            out, failed = _serve_passes(settings, what, prompts, max_new_tokens, load.concurrency, temperature,
                                        seed, log_dir)
        except UserError as e:  # vLLM refused the setting at start: named in the report, the sweep goes on
            out, failed = {}, getattr(e, "cause", str(e).splitlines()[0])
        if failed is not None:  # or failed a pass: the passes before it are kept
            print(f"[load] vLLM failed {what}: {failed}", flush=True)
            errors.append({"setting": what, "error": failed, "passes_kept": sorted(out)})
        return out or None

    print(f"[load] vLLM {vllm_engine.VERSION} server on loopback: {len(prompts)} prompts, {max_new_tokens} tokens, "
          f"concurrency {list(load.concurrency)}, K {list(load.ks)}, plain and {info.kind} from {info.path}",
          flush=True)
    plain = run(ServeSettings(verifier, **base), "plain")
    if plain is None:
        raise UserError(f"vLLM could not serve {verifier} plain: {errors[-1]['error']}")
    by_k = {k: run(ServeSettings(verifier, served, info.kind, k, **base), f"K={k}") for k in load.ks}
    rows = []
    for c in load.concurrency:
        p_pass, _ = plain[c]
        p = p_pass.summary()
        spec = [_spec_row(k, r[c][0], r[c][1], p, p_pass.outputs) for k, r in by_k.items() if r and c in r]
        paying = [s for s in spec if (s["speedup"] or 0) > 1.0]
        rows.append({"concurrency": c, "plain_tokens_per_s": p["tokens_per_s"],
                     "plain_per_request_tokens_per_s": p["per_request_tokens_per_s"], "plain_ttft_s": p["ttft_s"],
                     "spec": spec, "best_k": max(paying, key=lambda s: s["tokens_per_s"])["k"] if paying else 0})
    schedule = schedule_of(rows, most)
    record: dict[str, Any] = {"ranges": [list(r) for r in schedule], "as_vllm": {
        "num_speculative_tokens_per_batch_size": [list(r) for r in schedule]},
        "flag": format_schedule(schedule), "by_concurrency": {str(r["concurrency"]): r["best_k"] for r in rows}}
    drafting = any(k for _, _, k in schedule)
    scheduled = run(ServeSettings(verifier, served if drafting else None, info.kind if drafting else None,
                                  None, schedule if drafting else None, **base), "schedule")
    for row in rows:
        if scheduled is not None and row["concurrency"] in scheduled:
            s_pass, counts = scheduled[row["concurrency"]]
            tps = s_pass.summary()["tokens_per_s"]
            row["scheduled_tokens_per_s"] = tps
            row["scheduled_speedup"] = tps / row["plain_tokens_per_s"] if row["plain_tokens_per_s"] else None
            row["scheduled_counts"] = counts
    record["accepted_by_vllm"] = not any(e["setting"] == "schedule" for e in errors)
    result: dict[str, Any] = {
        "version": vllm_engine.VERSION, "server": "vllm.entrypoints.openai.api_server (serve/server.py), loopback",
        "setup": {"dtype": dtype, "threads": threads, "max_num_seqs": most, "enforce_eager": True,
                  "ld_preload": vllm_engine.engine_env(threads).get("LD_PRELOAD", ""),
                  "kv_cache_space": vllm_engine.engine_env(threads).get("VLLM_CPU_KVCACHE_SPACE"),
                  "timing": "closed loop per concurrency after one warm-up request; model load excluded",
                  "prompts": len(prompts), "max_new_tokens": max_new_tokens, "logs": str(log_dir)},
        "by_concurrency": rows, "schedule": record, "errors": errors,
        "measured_crossover": next((r["concurrency"] for r in rows if r["best_k"] == 0), None),
        "measured_best_k": {str(r["concurrency"]): r["best_k"] for r in rows},
    }
    if predict is not None:
        pred = predict(list(load.concurrency), list(load.ks))
        result["prediction"] = pred.record()
    # the batch-1 keys the rest of the report reads (the table's vLLM rows): the lowest concurrency
    first = rows[0]
    best = max(first["spec"], key=lambda s: s["tokens_per_s"], default=None)
    result["plain"] = {"tokens_per_s": first["plain_tokens_per_s"], "concurrency": first["concurrency"]}
    result["speculative"] = None if best is None else {
        "method": info.kind, "speculative_tokens": best["k"], "tokens_per_s": best["tokens_per_s"],
        "tau": best["acceptance_length"], "accept_rate_per_position": best["acceptance_per_position"],
        "speedup": best["speedup"], "concurrency": first["concurrency"]}
    print_table(result)
    result["plot"] = str(plot(result, out_dir / "load_speedup.png"))
    return result


def print_table(result: dict[str, Any]) -> None:
    """The sweep in the terminal: per concurrency, plain tok/s and each K's tok/s, speedup and acceptance."""
    from rich.console import Console
    from rich.table import Table

    rows = result["by_concurrency"]
    ks = sorted({s["k"] for r in rows for s in r["spec"]})
    table = Table(title=f"vLLM {result['version']} under load: output tokens/s (speedup over plain; acceptance "
                        f"length)")
    for col in ("concurrency", "plain", *(f"K={k}" for k in ks), "best K", "schedule", "predicted K"):
        table.add_column(col, justify="right")
    pred = (result.get("prediction") or {}).get("best_k", {})
    for r in rows:
        cells = {s["k"]: f"{s['tokens_per_s']:.1f} ({s['speedup']:.2f}x; {s['acceptance_length'] or 0:.2f})"
                 for s in r["spec"]}
        sched = r.get("scheduled_speedup")
        table.add_row(str(r["concurrency"]), f"{r['plain_tokens_per_s']:.1f}", *(cells.get(k, "refused") for k in ks),
                      str(r["best_k"]), "-" if sched is None else f"{r['scheduled_tokens_per_s']:.1f} ({sched:.2f}x)",
                      str(pred.get(str(r["concurrency"]), "-")))
    console = Console()
    console.print(table)
    console.print(f"schedule (vLLM num_speculative_tokens_per_batch_size): {result['schedule']['ranges']}; "
                  f"crossover measured {result['measured_crossover']}, predicted "
                  f"{(result.get('prediction') or {}).get('crossover', '-')}")
    for e in result["errors"]:
        console.print(f"vLLM refused {e['setting']}: {e['error']}")


def plot(result: dict[str, Any], path: Path) -> Path:
    """Speedup over plain against concurrency: one line per K, one for the schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["by_concurrency"]
    levels = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for k in sorted({s["k"] for r in rows for s in r["spec"]}):
        pts = [(r["concurrency"], s["speedup"]) for r in rows for s in r["spec"] if s["k"] == k]
        ax.plot(*zip(*pts), marker="o", label=f"K={k}")
    sched = [(r["concurrency"], r["scheduled_speedup"]) for r in rows if r.get("scheduled_speedup")]
    if sched:
        ax.plot(*zip(*sched), marker="s", color="black", linewidth=2, label="schedule")
    ax.axhline(1.0, color="gray", linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set(xlabel="concurrency (clients)", ylabel="output tokens/s over plain vLLM",
           title=f"vLLM {result['version']}: speedup under load")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
