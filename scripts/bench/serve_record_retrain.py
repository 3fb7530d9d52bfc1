"""Serve, record, retrain, measured: a stream of prompts unlike the drafter's training set is served with `--record`,
the drafter is fine-tuned on the record (with a replay sample of the shipped set), and vLLM's own acceptance counters
are read on held-out prompts of the same stream before and after the new weights are loaded into the running server
(`--reload-into`), which is also timed against a restart.

    python -m scripts.bench.serve_record_retrain --out outputs/serve-record      # phases: record, train, measure
    python -m scripts.bench.serve_record_retrain --out outputs/serve-record --phase measure   # again, on its export

The stream is HumanEval's 164 problems (the function signature and docstring as the user turn; code, which the
shipped set's chat prompts hold little of), in one fixed shuffle: the first --record-n are served and recorded, the
next --heldout-n are only measured. Prints and writes <out>/result.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from data.prompts import humaneval_records  # noqa: E402
from serve.server import counter_delta, spec_counters  # noqa: E402

EXPORT = ROOT / "pretrained" / "eagle3-smollm2"


def start(argv: list[str], log: Path, port: int) -> tuple[subprocess.Popen[bytes], float]:
    """`python -m serve ARGV` until it answers /health: (the process, seconds to ready)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "serve", *argv, "--port", str(port), "--max-num-seqs", "4",
                             "--max-model-len", "1024"], cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)


def ask(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": name, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0})
    r.raise_for_status()
    return r.json()


def ask_status(url: str, prompt: str, max_tokens: int) -> int:
    name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    return httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": name, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0}).status_code


def measure(url: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """vLLM's counters over `prompts`, one at a time: tau = 1 + accepted / drafts, per-position acceptance."""
    before = spec_counters(url)
    t0 = time.monotonic()
    tokens = sum(ask(url, p, max_tokens)["usage"]["completion_tokens"] for p in prompts)
    seconds = time.monotonic() - t0
    d = counter_delta(before, spec_counters(url))
    assert d is not None
    return {"tau": 1 + d["num_accepted_tokens"] / max(1, d["num_drafts"]), "drafts": d["num_drafts"],
            "accepted": d["num_accepted_tokens"], "alpha": [a / max(1, d["num_drafts"]) for a in d["accepted_per_pos"]],
            "tokens": tokens, "tokens_per_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=["all", "record", "train", "measure"], default="all")
    parser.add_argument("--record-n", type=int, default=64)
    parser.add_argument("--heldout-n", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--replay", type=int, default=64, help="rows of the shipped set beside the record")
    parser.add_argument("--port", type=int, default=8181)
    parser.add_argument("--train-args", nargs="*", default=[])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    records = humaneval_records()
    random.Random(0).shuffle(records)
    stream = [r["prompt"] for r in records[: args.record_n]]
    heldout = [r["prompt"] for r in records[args.record_n: args.record_n + args.heldout_n]]
    record, run = args.out / "record", args.out / "run"
    result_path = args.out / "result.json"
    result: dict[str, Any] = json.loads(result_path.read_text()) if result_path.is_file() else {}
    result |= {"machine": os.uname().machine, "cpus": os.cpu_count(), "stream": "HumanEval, fixed shuffle (seed 0)",
               "record_n": args.record_n, "heldout_n": args.heldout_n, "max_tokens": args.max_tokens}

    if args.phase in ("all", "record"):
        proc, ready = start([str(EXPORT), "--record", str(record)], args.out / "serve-record.log", args.port)
        try:
            result["recorded_stream"] = measure(url, stream, args.max_tokens)  # the shipped drafter, as recorded
        finally:
            stop(proc)
        result["start_seconds_record"] = ready
        print("recorded:", result["recorded_stream"], flush=True)
        result_path.write_text(json.dumps(result, indent=1))

    if args.phase in ("all", "train"):
        t0 = time.monotonic()
        cmd = [sys.executable, "train.py", "experiment=retrain_served", f"data.source={record}",
               f"data.shipped=[smollm2-selfdistill-v1@{args.replay}]", "logger=csv", "overwrite=true",
               f"hydra.run.dir={run}", *args.train_args]
        with open(args.out / "train.log", "wb") as log:
            subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
        result["train"] = {"command": " ".join(cmd[1:]), "seconds": time.monotonic() - t0}
        result_path.write_text(json.dumps(result, indent=1))

    if args.phase in ("all", "measure"):
        proc, ready = start([str(EXPORT), "--reloadable"], args.out / "serve-measure.log", args.port)
        try:
            result["heldout_before"] = measure(url, heldout, args.max_tokens)
            print("held-out, shipped drafter:", result["heldout_before"], flush=True)
            traffic: list[tuple[float, float, int]] = []  # (sent, seconds, status) of requests during the reload
            done = threading.Event()

            def keep_asking() -> None:
                while not done.is_set():
                    t = time.monotonic()
                    try:
                        status = ask_status(url, heldout[0], 32)
                    except httpx.HTTPError:
                        status = -1
                    traffic.append((t, time.monotonic() - t, status))

            worker = threading.Thread(target=keep_asking)
            worker.start()
            t0 = time.monotonic()
            said = subprocess.run([sys.executable, "-m", "serve", str(run / "export"), "--reload-into", url],
                                  cwd=ROOT, check=True, capture_output=True, text=True).stdout
            time.sleep(2)
            done.set()
            worker.join()
            result["reload"] = {"command_seconds": time.monotonic() - t0, "said": said.strip().splitlines()[-1],
                                "requests_meanwhile": len(traffic), "failed": sum(st != 200 for _, _, st in traffic),
                                "slowest_seconds": max((d for _, d, _ in traffic), default=0.0)}
            result["heldout_after"] = measure(url, heldout, args.max_tokens)
            print("held-out, retrained drafter (reloaded):", result["heldout_after"], flush=True)
            result["stream_after"] = measure(url, stream[:16], args.max_tokens)  # recorded prompts, for scale
        finally:
            t0 = time.monotonic()
            stop(proc)
            stopped = time.monotonic() - t0
        proc, ready = start([str(run / "export")], args.out / "serve-restart.log", args.port)
        try:
            result["restart_gap_seconds"] = {"stop": stopped, "start_to_ready": ready, "total": stopped + ready}
            result["heldout_after_restart"] = measure(url, heldout, args.max_tokens)
        finally:
            stop(proc)
        result_path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
