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
(batch_cost.py: the best K per batch size and the crossover predicted from this machine's verify costs and the
export's acceptance, beside the measured ones). A setting vLLM refuses is named in `errors` and the sweep goes on.

engine_prompt_lengths=[short,long] (eval/serving/prompt_lengths.py): every pass runs once per length group on the same
servers; `by_length.<group>` holds the group's prompts (count, tokens median/min/max), its own `by_concurrency`,
best K per concurrency, schedule (measured on a server of its own where it differs from the whole set's) and
crossover; the whole-set keys above pool the groups' passes (their tokens over their seconds, every request).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eval.serving.prompt_lengths import LengthGroup, PromptGroup, group_prompts, parse_lengths, rendered_pool
from runtime.errors import UserError

PORT = 18400  # loopback port of the sweep's servers (a free one is looked for from here)


@dataclass(frozen=True)
class LoadSettings:
    """engine_concurrency, engine_peer_tokens and engine_prompt_lengths as the sweep takes them, checked at the
    door (load_settings: `ks` empty where none was given); then the export swept, read once by the run's setup and
    checked against them (with_export: the export's own K where none was given); then the length groups' prompts,
    once the verifier's tokenizer has rendered them (with_groups)."""

    concurrency: tuple[int, ...]
    ks: tuple[int, ...]
    export: Any = None  # the export swept (models.exports.io.ExportInfo), as the run read it
    lengths: tuple[LengthGroup, ...] = ()
    groups: tuple[PromptGroup, ...] = ()


def _whole_list(value: Any, key: str) -> list[Any]:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return list(value) if isinstance(value, list | tuple) else [value]


def load_settings(concurrency: Any, tokens: Any, peers: Sequence[str], export: str | None,
                  lengths: Any = None) -> LoadSettings | None:
    """engine_concurrency (None or [] : no sweep), engine_peer_tokens and engine_prompt_lengths, refused before
    anything is read: a concurrency of 0 or below, engine_concurrency without engine_peers or an export, a K that is
    not whole; several K, or length groups, without engine_concurrency; an unknown length group
    (eval/serving/prompt_lengths.py). What needs the export's config.json (a K beyond what it drafts, a family vLLM
    does not serve) is with_export's, in the run's one check."""
    ks_given = None if tokens is None else _whole_list(tokens, "engine_peer_tokens")
    groups = parse_lengths(None if lengths is None else _whole_list(lengths, "engine_prompt_lengths"))
    if concurrency is None or _whole_list(concurrency, "engine_concurrency") == []:
        if ks_given is not None and not isinstance(tokens, int):
            raise UserError(f"engine_peer_tokens={ks_given}: a list of K is swept under load only; add "
                            f"engine_concurrency=[1,2,4,...], or give one K (engine_peer_tokens=3).")
        if groups:
            raise UserError(f"engine_prompt_lengths={[g.name for g in groups]} splits the load sweep by prompt "
                            f"length, and no sweep was asked for; add engine_concurrency=[1,2,4,8,16] (with "
                            f"engine_peers=[vllm]), or leave engine_prompt_lengths out.")
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
    from serve.server import check_tokens

    check_tokens(ks_given or [], {}, Path(export), "engine_peer_tokens")  # whole and >= 1; the export's bound later
    return LoadSettings(tuple(sorted(set(levels))), tuple(sorted(set(ks_given or []))), None, groups)


def with_export(load: LoadSettings | None, info: Any) -> LoadSettings | None:
    """`load` with the export it sweeps (`info`, its ExportInfo as the run read it), refused where vLLM does not
    serve its family on this build or it drafts fewer tokens than a K asked (serve.server.check_servable,
    check_tokens); the K are the export's own where none was given."""
    from serve.server import check_servable, check_tokens

    if load is None:
        return None
    check_servable(info)
    ks = load.ks or (info.speculative_tokens or 3,)
    check_tokens(list(ks), info.config, info.path, "engine_peer_tokens")
    return replace(load, ks=ks, export=info)


def with_groups(load: LoadSettings | None, pool: Sequence[Sequence[Any]], source: str, num: int | None,
                verifier: Any) -> LoadSettings | None:
    """`load` with its length groups' prompts drawn from `pool` (every eval prompt of the run's prompt set(s), set
    by set: data.prompts.load_prompt_pool) as `verifier` renders them (prompt_lengths.py; a group no prompt falls
    into is refused here, before any pass); unchanged where no groups were asked for."""
    if load is None or not load.lengths:
        return load
    rendered = rendered_pool(pool, verifier.tokenizer, verifier.rendering)
    return replace(load, groups=group_prompts(load.lengths, rendered, num, source))


def predictor(run: Any, prefix: list[int]) -> Callable[[list[int], list[int]], Any]:
    """The batch cost model for a `python -m eval` run (its eval.setup.Run): its verifier and export, and the drafter's
    batch-1 draft curve where the run measured one (tree.size=auto)."""
    sizes = run.curves[0].sizes if run.curves and run.draft_curve else None
    return batch_predictor(run.verifier.model, run.exports[0].acceptance, prefix, sizes, run.draft_curve)


def batch_predictor(model: Any, acceptance: Any, prefix: list[int], sizes: Sequence[int] | None = None,
                    draft_curve: Sequence[float] | None = None) -> Callable[[list[int], list[int]], Any]:
    """The batch cost model (eval/serving/batch_cost.py): verify costs of `model` measured when called, on the prefix
    `prefix`, the export's acceptance table, the draft curve (ms at `sizes` nodes) or no draft cost."""

    def predict(levels: list[int], ks: list[int]) -> Any:
        import torch

        from eval.serving.batch_cost import draft_ms_per_k, predict, verify_costs

        print(f"[load] the batch cost model: verify costs at batch sizes {levels}, widths K + 1", flush=True)
        costs = verify_costs(model, torch.tensor([prefix]), levels, sorted({1, *(k + 1 for k in ks)}))
        return predict(costs, levels, ks, acceptance, draft_ms_per_k(sizes, draft_curve, ks))

    return predict


def check_clients(load: LoadSettings | None, prompts: int) -> None:
    """Refuse a concurrency above the prompts a pass has (a closed loop cannot keep more requests in flight than it
    has prompts: the pass would run at a lower concurrency than it is reported at), before any server starts."""
    if load is None:
        return
    counts = {g.group.name: len(g.prompts) for g in load.groups} or {"the run": prompts}
    for name, n in counts.items():
        over = [c for c in load.concurrency if c > n]
        if over:
            where = "the run has" if name == "the run" else f"the length group {name!r} has"
            raise UserError(f"engine_concurrency={list(load.concurrency)}: {where} {n} prompts, so at most {n} "
                            f"requests can be in flight, not {over[0]}; give num_prompts >= {max(over)} (or more "
                            f"prompts in that group, {name}:{max(over)}), or drop the concurrencies above {n}.")


def schedule_of(rows: Sequence[dict[str, Any]], most: int) -> tuple[tuple[int, int, int], ...] | None:
    """The K per batch-size range that gave the most output tokens/s: batch sizes above the previous measured
    concurrency up to this one take its best K (0 where no K beat plain), the last range reaching `most`;
    neighbouring ranges of one K merged. None where a row misses a K (its server failed): no schedule is derived
    from passes that did not run."""
    if not rows or any(row["best_k"] is None for row in rows):
        return None
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


ALL = "all"  # the whole set's view: every group's passes pooled

Passes = dict[tuple[str, int], tuple[Any, dict[str, Any] | None]]  # (group, concurrency) -> (pass, counters added)


def _serve_passes(settings: Any, label: str, sets: dict[str, list[list[int]]], max_tokens: int,
                  levels: Sequence[int], temperature: float, seed: int, log_dir: Path) -> tuple[Passes, str | None]:
    """One server, every group's prompts at every concurrency: (the pass, the counters it added) per (group,
    concurrency), and the cause vLLM's log names where it failed a pass (the passes before it are kept)."""
    import httpx

    from serve.client import run_pass
    from serve.server import Server, counter_delta, spec_counters
    from serve.vllm_engine import log_cause

    out: Passes = {}
    server = Server(settings, log=log_dir / f"vllm-{label.replace('=', '')}.log")
    with server:
        try:
            run_pass(settings.url, settings.name, next(iter(sets.values()))[:1], 4, 1)  # warm-up: kernels, caches
            for name, prompts in sets.items():
                for c in levels:
                    before = spec_counters(settings.url)
                    passed = run_pass(settings.url, settings.name, prompts, max_tokens, c, temperature, seed)
                    out[name, c] = (passed, counter_delta(before, spec_counters(settings.url)))
                    group = "" if name == ALL else f" {name} prompts"
                    print(f"[load] {label},{group} concurrency {c}: {passed.summary()['tokens_per_s']:.1f} tok/s",
                          flush=True)
        except (RuntimeError, httpx.HTTPError) as e:
            time.sleep(2)  # the engine's traceback reaches the log
            assert server.log is not None
            return out, f"{log_cause(server.log.read_text(errors='replace'))} (client: {str(e)[:200]})"
    return out, None


def _pooled(passes: Passes | None, names: Sequence[str], c: int) -> tuple[Any, dict[str, Any] | None] | None:
    """The passes of groups `names` at concurrency `c` as one: every request, their tokens over their seconds, the
    counters summed (None where one of them is missing)."""
    from serve.client import Pass

    got = [passes[n, c] for n in names if (n, c) in passes] if passes else []
    if not got or len(got) != len(names):
        return None
    if len(got) == 1:
        return got[0]
    counts = [n for _, n in got if n is not None]
    total = None if not counts else {k: sum(n[k] for n in counts) for k in counts[0] if k != "accepted_per_pos"}
    if total is not None:
        width = max(len(n["accepted_per_pos"]) for n in counts)
        total["accepted_per_pos"] = [sum((n["accepted_per_pos"] + [0] * width)[i] for n in counts)
                                     for i in range(width)]
    return Pass(c, [a for p, _ in got for a in p.answers], sum(p.seconds for p, _ in got)), total


def _rows(levels: Sequence[int], plain: Passes, by_k: dict[int, Passes | None], names: Sequence[str],
          failed: dict[str, str]) -> list[dict[str, Any]]:
    """by_concurrency over groups `names`: plain and each K per concurrency, the best K (0 where none pays). A pass
    whose server failed (`failed`: the setting's label -> vLLM's cause) is an error row, or an error entry for that
    K, and the concurrency's best K is then unknown (None)."""
    rows: list[dict[str, Any]] = []
    for c in levels:
        got = _pooled(plain, names, c)
        if got is None:
            rows.append({"concurrency": c, "error": failed.get("plain", "no plain pass"), "spec": [], "best_k": None})
            continue
        p_pass = got[0]
        p = p_pass.summary()
        spec = [_spec_row(k, s[0], s[1], p, p_pass.outputs) if (s := _pooled(r, names, c)) is not None else
                {"k": k, "error": failed.get(f"K={k}", "no pass")} for k, r in by_k.items()]
        done = [s for s in spec if "error" not in s]
        paying = [s for s in done if (s["speedup"] or 0) > 1.0]
        best = max(paying, key=lambda s: s["tokens_per_s"])["k"] if paying else 0
        rows.append({"concurrency": c, "plain_tokens_per_s": p["tokens_per_s"],
                     "plain_per_request_tokens_per_s": p["per_request_tokens_per_s"], "plain_ttft_s": p["ttft_s"],
                     "spec": spec, "best_k": best if len(done) == len(spec) else None})
    return rows


def _add_scheduled(rows: list[dict[str, Any]], scheduled: Passes | None, names: Sequence[str]) -> None:
    for row in rows:
        got = _pooled(scheduled, names, row["concurrency"])
        if got is not None and "error" not in row:
            tps = got[0].summary()["tokens_per_s"]
            row["scheduled_tokens_per_s"] = tps
            row["scheduled_speedup"] = tps / row["plain_tokens_per_s"] if row["plain_tokens_per_s"] else None
            row["scheduled_counts"] = got[1]


def _schedule_record(schedule: tuple[tuple[int, int, int], ...] | None, rows: list[dict[str, Any]],
                     accepted: bool | None) -> dict[str, Any] | None:
    """The schedule as report.json keeps it; `accepted`: whether vLLM served it (None: not started, as where it
    drafts nothing: that is plain decoding, and plain was measured)."""
    from serve.server import format_schedule

    if schedule is None:
        return None
    return {"ranges": [list(r) for r in schedule],
            "as_vllm": {"num_speculative_tokens_per_batch_size": [list(r) for r in schedule]},
            "flag": format_schedule(schedule), "by_concurrency": {str(r["concurrency"]): r["best_k"] for r in rows},
            "accepted_by_vllm": accepted}


def to_measure(schedules: Any) -> list[tuple[tuple[int, int, int], ...]]:
    """The distinct schedules worth a server of their own: derived (not None) and drafting somewhere (one of K=0
    everywhere is plain decoding, which the sweep measured already: serving it would compare plain with plain)."""
    return [s for s in dict.fromkeys(schedules) if s is not None and any(k for _, _, k in s)]


def _crossover(rows: Sequence[dict[str, Any]]) -> int | None:
    """The lowest concurrency where no K beat plain; None where none, or where a failed pass leaves it unknown."""
    for r in rows:
        if r["best_k"] is None:
            return None
        if r["best_k"] == 0:
            return int(r["concurrency"])
    return None


def _schedule_note(schedule: tuple[tuple[int, int, int], ...] | None) -> str | None:
    """What a schedule that is missing, or that drafts nothing, means for serving."""
    if schedule is None:
        return ("no schedule: a pass failed (errors), so the best K is unknown at some concurrency; fix what vLLM "
                "names there and run the sweep again")
    if not any(k for _, _, k in schedule):
        return ("no K beat plain at any concurrency measured: serve the verifier alone (python -m serve EXPORT "
                "--plain); a schedule of K=0 still runs the drafter every step in this vLLM")
    return None


def sweep(load: LoadSettings, verifier: Any, prompts: list[list[int]], max_new_tokens: int, dtype: str,
          threads: int | None, temperature: float, seed: int, out_dir: Path,
          cache_dir: str | None = None, predict: Any = None) -> dict[str, Any]:
    """The whole sweep (module docstring) of the export `load` holds (with_export), on `prompts`, or on the length
    groups' prompts where `load` has them, served with `verifier`'s checkpoint (the run's verifier: nothing is loaded
    again here); `predict(levels, ks)`: the batch cost model's Prediction, or None."""
    from serve import vllm_engine
    from serve.server import ServeSettings, served_folder, served_name, vllm_checkpoint

    info = load.export
    check_clients(load, len(prompts))
    served = served_folder(info.path, info.config, verifier, cache_dir)
    verifier = vllm_checkpoint(verifier)
    most = max(load.concurrency)
    sets = {g.group.name: [list(p) for p in g.prompts] for g in load.groups} or {ALL: prompts}
    every = [p for ps in sets.values() for p in ps]
    # prefix caching off: every pass sends the same prompts, and with it each pass after a server's first would
    # skip their prefill (a 1,400-token prompt's is seconds here), as no fresh request does
    base: dict[str, Any] = dict(max_num_seqs=most, dtype=dtype, threads=threads, name=served_name(info.path),
                                port=_free_port(PORT), prefix_caching=False,
                                max_model_len=max(len(p) for p in every) + max_new_tokens + max(load.ks) + 16)
    log_dir = out_dir / "vllm_load"
    log_dir.mkdir(parents=True, exist_ok=True)
    errors: list[dict[str, Any]] = []

    def run(settings: Any, what: str, names: Sequence[str] = tuple(sets)) -> Passes | None:
        try:
            out, failed = _serve_passes(settings, what, {n: sets[n] for n in names}, max_new_tokens,
                                        load.concurrency, temperature, seed, log_dir)
        except UserError as e:  # vLLM refused the setting at start: named in the report, the sweep goes on
            out, failed = {}, getattr(e, "cause", str(e).splitlines()[0])
        if failed is not None:  # or failed a pass: the passes before it are kept
            print(f"[load] vLLM failed {what}: {failed}", flush=True)
            errors.append({"setting": what, "error": failed,
                           "passes_kept": [c if n == ALL else [n, c] for n, c in sorted(out)]})
        return out or None

    groups = "" if ALL in sets else " in groups " + ", ".join(f"{n} ({len(ps)})" for n, ps in sets.items())
    print(f"[load] vLLM {vllm_engine.VERSION} server on loopback: {len(every)} prompts{groups}, {max_new_tokens} "
          f"tokens, concurrency {list(load.concurrency)}, K {list(load.ks)}, plain and {info.kind} from {info.path}",
          flush=True)
    plain = run(ServeSettings(verifier, **base), "plain")
    if plain is None:
        raise UserError(f"vLLM could not serve {verifier} plain: {errors[-1]['error']}")
    by_k = {k: run(ServeSettings(verifier, served, info.kind, k, **base), f"K={k}") for k in load.ks}
    # the views: the whole set (every group pooled), then each group alone
    views = {ALL: tuple(sets), **{n: (n,) for n in sets if n != ALL}}
    causes = {e["setting"]: e["error"] for e in errors}
    rows = {v: _rows(load.concurrency, plain, by_k, names, causes) for v, names in views.items()}
    schedules = {v: schedule_of(r, most) for v, r in rows.items()}
    accepted: dict[Any, bool | None] = {None: None}
    # one more server per distinct schedule that drafts somewhere: the whole set's, on every group; a group whose
    # schedule differs, alone. One that drafts nothing is plain decoding, already measured: no server, no speedup.
    for schedule in to_measure(schedules.values()):
        own = [v for v in views if schedules[v] == schedule]
        names = tuple(sets) if ALL in own else own
        label = "schedule" if ALL in own else "schedule-" + "-".join(own)
        scheduled = run(ServeSettings(verifier, served, info.kind, None, schedule, **base), label, names)
        accepted[schedule] = label not in {e["setting"] for e in errors}
        for v in own:
            _add_scheduled(rows[v], scheduled, views[v])
    whole = rows[ALL]
    result: dict[str, Any] = {
        "version": vllm_engine.VERSION, "server": "vllm.entrypoints.openai.api_server (serve/server.py), loopback",
        "setup": {"dtype": dtype, "threads": threads, "max_num_seqs": most, "enforce_eager": True,
                  "max_model_len": base["max_model_len"], "prefix_caching": False,
                  "ld_preload": vllm_engine.engine_env(threads).get("LD_PRELOAD", ""),
                  "kv_cache_space": vllm_engine.engine_env(threads).get("VLLM_CPU_KVCACHE_SPACE"),
                  "timing": "closed loop per concurrency after one warm-up request; model load excluded",
                  "prompts": len(every), "max_new_tokens": max_new_tokens, "logs": str(log_dir)},
        "by_concurrency": whole,
        "schedule": _schedule_record(schedules[ALL], whole, accepted.get(schedules[ALL])),
        "schedule_note": _schedule_note(schedules[ALL]),
        "errors": errors,
        "measured_crossover": _crossover(whole),
        "measured_best_k": {str(r["concurrency"]): r["best_k"] for r in whole},
    }
    if load.groups:
        result["setup"]["lengths"] = [g.group.name for g in load.groups]
        result["by_length"] = {g.group.name: {
            **g.record(), "by_concurrency": rows[g.group.name],
            "schedule": _schedule_record(schedules[g.group.name], rows[g.group.name],
                                         accepted.get(schedules[g.group.name])),
            "schedule_note": _schedule_note(schedules[g.group.name]),
            "measured_crossover": _crossover(rows[g.group.name]),
            "measured_best_k": {str(r["concurrency"]): r["best_k"] for r in rows[g.group.name]},
        } for g in load.groups}
    if predict is not None:
        pred = predict(list(load.concurrency), list(load.ks))
        result["prediction"] = pred.record()
    # the batch-1 keys the rest of the report reads (the table's vLLM rows): the lowest concurrency
    first = next(r for r in whole if "error" not in r)  # plain ran at some concurrency (else refused above)
    best = max((s for s in first["spec"] if "error" not in s), key=lambda s: s["tokens_per_s"], default=None)
    result["plain"] = {"tokens_per_s": first["plain_tokens_per_s"], "concurrency": first["concurrency"]}
    result["speculative"] = None if best is None else {
        "method": info.kind, "speculative_tokens": best["k"], "tokens_per_s": best["tokens_per_s"],
        "tau": best["acceptance_length"], "accept_rate_per_position": best["acceptance_per_position"],
        "speedup": best["speedup"], "concurrency": first["concurrency"]}
    from eval.serving.report import plot, print_table

    print_table(result)
    result["plot"] = str(plot(result, out_dir / "load_speedup.png"))
    return result
