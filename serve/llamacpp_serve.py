"""`python -m serve EXPORT --engine llamacpp`: llama.cpp's llama-server with the export's GGUF files (serve/gguf.py),
loopback by default, the OpenAI-compatible routes (/v1/completions, /v1/chat/completions, /v1/models) that
serve/client.py speaks, under runtime/lifetime.py's watchdog (serve/llamacpp_engine.py).

    python -m serve gguf/eagle3-smollm2 --engine llamacpp                 # a folder `convert gguf` wrote
    python -m serve pretrained/eagle3-smollm2 --engine llamacpp --quant q8_0 --tokens 1
    python -m serve pretrained/medusa-smollm2 --engine llamacpp --plain  # any export's verifier, alone

EXPORT is a folder `python -m scripts.tools.convert gguf` wrote, or an export, converted once into
<cache>/gguf/<name>-<hash>/ with the asked quantization. K (--tokens) and the confidence cut (--p-min) default to
the folder's launch.json (written by the conversion, rewritable by a sweep), else K=3, p-min 0.6.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from runtime.errors import UserError
from serve import gguf, llamacpp_engine

# vLLM's options that mean nothing to llama.cpp here, and why
VLLM_ONLY = {"schedule": "K per batch-size range is vLLM's (num_speculative_tokens_per_batch_size); give --tokens",
             "record": "recording served requests is done inside vLLM's server (its middleware)",
             "reloadable": "reloading drafter weights in place is done inside vLLM's workers",
             "reload_into": "reloading drafter weights in place is done inside vLLM's workers",
             "dtype": "llama.cpp runs the GGUF's own types: give --quant (bf16, f32, q8_0, q4_k_m, q4_1)",
             "max_num_seqs": "this launcher serves one request at a time (llama-server -np 1)"}


def check_options(args: argparse.Namespace) -> None:
    """Refuse what llama.cpp would take and ignore, before anything loads."""
    for name, why in VLLM_ONLY.items():
        value = getattr(args, name, None)
        if value not in (None, False):
            raise UserError(f"--{name.replace('_', '-')} is not available with --engine llamacpp: {why}. Drop it, or "
                            f"serve with vLLM (--engine vllm).")
    if args.plain and (args.tokens is not None or args.p_min is not None):
        given = "--tokens" if args.tokens is not None else "--p-min"
        raise UserError(f"--plain serves the verifier alone, so {given} has nothing to set; drop one of the two.")
    if args.tokens is not None and args.tokens < 1:
        raise UserError(f"--tokens {args.tokens}: give 1 or more tokens drafted a step (or --plain for none).")
    if args.p_min is not None and not 0.0 <= args.p_min < 1.0:
        raise UserError(f"--p-min {args.p_min}: give a probability from 0 (never cut a draft) to below 1.")
    gguf.check_quants([args.quant or "bf16"], None if args.quant != "q4_1" else {"loader": "smollm2"})


def converted_folder(export: Path, quant: str, plain: bool, cache_dir: str | None) -> Path:
    """EXPORT itself when `convert gguf` wrote it (with the asked quantization), else its conversion in the cache,
    made once."""
    if (export / gguf.MANIFEST).is_file():
        files = json.loads((export / gguf.MANIFEST).read_text())["verifier"]["files"]
        if quant not in files:
            raise UserError(f"{export} holds the verifier as {sorted(files)}, not {quant}: give one of those to "
                            f"--quant, or convert again: python -m scripts.tools.convert gguf EXPORT {export} --quant "
                            f"{','.join([*files, quant])} --force")
        return export
    key = hashlib.sha256(f"{export.resolve()}|{(export / 'config.json').stat().st_mtime_ns}".encode()).hexdigest()
    base = Path(cache_dir or os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft")).expanduser()
    out = base / "gguf" / f"{export.resolve().name}-{key[:12]}-{quant}{'-plain' if plain else ''}"
    if not (out / gguf.MANIFEST).is_file():
        print(f"[serve] converting {export} for llama.cpp into {out} (once)", flush=True)
        gguf.convert(export, out, [quant], draft=not plain, cache_dir=cache_dir, force=True)
    return out


def settings_for(args: argparse.Namespace) -> llamacpp_engine.ServerSettings:
    export = Path(args.export).expanduser()
    if not (export / "config.json").is_file() and not (export / gguf.MANIFEST).is_file():
        raise UserError(f"{export}: no export (config.json) and no llama.cpp conversion ({gguf.MANIFEST}) there; give "
                        f"an export folder or what `python -m scripts.tools.convert gguf` wrote.")
    quant = args.quant or "bf16"
    if not args.plain and not (export / gguf.MANIFEST).is_file():
        from models.exports.io import export_kind, read_config

        if (why := gguf.refusal(export_kind(read_config(export)))) is not None:
            raise UserError(why)
    llamacpp_engine.tools()
    folder = converted_folder(export, quant, args.plain, args.cache_dir)
    manifest = json.loads((folder / gguf.MANIFEST).read_text())
    draft = None
    if not args.plain:
        if "draft" not in manifest:
            raise UserError(gguf.refusal(manifest.get("kind")) or f"{folder} holds no drafter GGUF (converted with "
                                                                  f"--verifier-only): serve it --plain.")
        draft = folder / manifest["draft"]
    launch = gguf.read_launch(folder)
    return llamacpp_engine.ServerSettings(
        folder / manifest["verifier"]["files"][quant], draft, None if args.plain else manifest["kind"],
        int(args.tokens if args.tokens is not None else launch["tokens"]),
        float(args.p_min if args.p_min is not None else launch["p_min"]), args.threads, args.host, args.port,
        args.max_model_len, alias=export.resolve().name, api_key=args.api_key)


def main(args: argparse.Namespace) -> int:
    """Serve until stopped (SIGINT, SIGTERM, SIGHUP), as `python -m serve` does for vLLM."""
    from runtime.lifetime import stop_on_signals
    from serve.server import check_address, loopback

    ready = False
    try:
        check_options(args)
        if not args.print_command:
            check_address(args.host, args.port)
        if not loopback(args.host) and not args.api_key:
            print(f"warning: --host {args.host} serves to every network this machine is on, with no API key. Add "
                  f"--api-key KEY, or serve on 127.0.0.1.", file=sys.stderr, flush=True)
        settings = settings_for(args)
        if args.print_command:
            print(" ".join(settings.command()))
            return 0
        stop_on_signals()
        what = "plain" if settings.draft is None else (f"drafting with {settings.draft.name}, K={settings.tokens}, "
                                                       f"p-min {settings.p_min}")
        print(f"[serve] starting llama-server {llamacpp_engine.VERSION}: {settings.model.name}, {what}", flush=True)
        with llamacpp_engine.LlamaServer(settings) as server:
            ready = True
            pid = server.proc.pid if server.proc is not None else None
            print(f"[serve] ready at {settings.url}/v1 (process group {pid}, log: {server.log}); Ctrl-C or SIGTERM "
                  f"stops it. Try:\n  curl {settings.url}/v1/completions -H 'Content-Type: application/json' -d "
                  f"'{{\"model\": \"{settings.alias}\", \"prompt\": \"What is a prime number?\", \"max_tokens\": "
                  f"32}}'", flush=True)
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1)
            raise UserError(f"llama-server ended (exit {server.proc.returncode if server.proc else '?'}); its log "
                            f"{server.log}:\n{server.log_tail()}")
    except KeyboardInterrupt as e:
        print(f"[serve] stopped ({e or 'Ctrl-C'}){'' if ready else ' while starting'}; llama-server's process group "
              f"is down", file=sys.stderr, flush=True)
        return 0 if ready else 130
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
