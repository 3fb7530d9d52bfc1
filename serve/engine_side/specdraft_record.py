"""Runs inside vLLM's API server (`--middleware specdraft_record.Recorder`, this folder on its PYTHONPATH), never
imported by the project: standard library only, so the vLLM interpreter loads nothing of ours.

For each POST to /v1/chat/completions or /v1/completions it asks vLLM for the token ids (`return_token_ids`, and for
chat the rendered prompt, `return_prompt_text`), lets vLLM answer, and appends one JSON line per finished request to
$SPECDRAFT_RECORD_DIR/records.jsonl: the prompt's ids as vLLM tokenised them (the chat template's rendering for chat),
each choice's answer ids and finish reason, the messages or prompt as sent, the rendered prompt text, the sampling
settings and the time. The line is written and flushed when the response ends, so a killed server loses no finished
request. Streamed responses are recorded too (prompt ids from the first chunk, the answer from the chunks' deltas).
Fields the client did not ask for are taken out of what it receives (set back to null where vLLM would send null),
so clients see vLLM's normal API. A request vLLM refused (a status other than 200) is not recorded.

`POST /specdraft/reload_drafter {"path": FOLDER}` loads a new drafter export's weights into the running engine
(specdraft_reload.DrafterReload, the worker extension, through vLLM's collective_rpc); it answers 404 unless the
server was started with that extension, and asks for the server's API key where one is set.
"""

from __future__ import annotations

import asyncio
import glob
import hmac
import json
import os
import struct
import sys
import threading
import time
from typing import Any

ROUTES = ("/v1/chat/completions", "/v1/completions")
RELOAD = "/specdraft/reload_drafter"
ASKED = ("return_token_ids", "return_prompt_text")  # what we ask vLLM for; stripped again unless the client asked
SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop",
            "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos")
# config.json fields that shape the drafter vLLM built (the rest is training metadata): a reload must keep them all
STRUCTURE = ("architectures", "speculators_model_type", "transformer_layer_config", "draft_vocab_size",
             "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
             "target_hidden_size", "verifier_fingerprint", "eagle_kind", "model_type", "hidden_size",
             "num_hidden_layers")
_lock = threading.Lock()


def record_path() -> str:
    return os.path.join(os.environ["SPECDRAFT_RECORD_DIR"], "records.jsonl")


def append(record: dict[str, Any]) -> None:
    """One line, written whole and flushed to disk before the response's last byte goes out."""
    line = json.dumps(record, separators=(",", ":")) + "\n"
    with _lock, open(record_path(), "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def strip(obj: dict[str, Any], asked: dict[str, Any]) -> dict[str, Any]:
    """The response as vLLM sends it when the fields were not asked for: null again."""
    if not asked.get("return_token_ids"):
        if obj.get("prompt_token_ids") is not None:
            obj["prompt_token_ids"] = None
        for choice in obj.get("choices") or []:
            for key in ("token_ids", "prompt_token_ids"):
                if choice.get(key) is not None:
                    choice[key] = None
    if not asked.get("return_prompt_text") and obj.get("prompt_text") is not None:
        obj["prompt_text"] = None
    return obj


class Capture:
    """What one request's response says, gathered as it passes (whole or streamed)."""

    def __init__(self, path: str, request: dict[str, Any]) -> None:
        self.path, self.request = path, request
        self.prompt_ids: dict[int, list[int]] = {}  # per choice (completions: each prompt of a batch is a choice)
        self.top_prompt_ids: list[int] | None = None
        self.prompt_text: str | None = None
        self.answers: dict[int, list[int]] = {}
        self.finish: dict[int, str | None] = {}
        self.id: str | None = None

    def read(self, obj: dict[str, Any], delta: bool) -> None:
        self.id = self.id or obj.get("id")
        if obj.get("prompt_token_ids") is not None:
            self.top_prompt_ids = list(obj["prompt_token_ids"])
        if obj.get("prompt_text") is not None:
            self.prompt_text = obj["prompt_text"]
        for choice in obj.get("choices") or []:
            i = int(choice.get("index", 0))
            if choice.get("prompt_token_ids") is not None:
                self.prompt_ids[i] = list(choice["prompt_token_ids"])
            ids = choice.get("token_ids")
            if ids is not None:
                self.answers[i] = (self.answers.get(i, []) + list(ids)) if delta else list(ids)
            else:
                self.answers.setdefault(i, [])
            if choice.get("finish_reason") is not None or not delta:
                self.finish[i] = choice.get("finish_reason")

    def record(self) -> dict[str, Any] | None:
        if not self.answers:
            return None
        req = self.request
        choices = [{"index": i, "prompt_ids": self.prompt_ids.get(i, self.top_prompt_ids),
                    "answer_ids": self.answers[i], "finish_reason": self.finish.get(i)} for i in sorted(self.answers)]
        out: dict[str, Any] = {"time": time.time(), "endpoint": self.path, "id": self.id, "model": req.get("model"),
                               "stream": bool(req.get("stream")), "choices": choices,
                               "sampling": {k: req[k] for k in SAMPLING if k in req}}
        if "messages" in req:
            out["messages"] = req["messages"]
            out["prompt_text"] = self.prompt_text
            for key in ("chat_template_kwargs", "add_generation_prompt", "continue_final_message", "tools"):
                if key in req:
                    out[key] = req[key]
        else:
            out["prompt"] = req.get("prompt")
        return out


class Recorder:
    """Pure ASGI middleware (streamed responses pass through chunk by chunk)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.dir = os.environ.get("SPECDRAFT_RECORD_DIR")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        if scope.get("path") == RELOAD:
            return await reload_drafter(scope, receive, send)
        if self.dir is None or scope.get("path") not in ROUTES:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict):  # vLLM answers what it cannot read; nothing to record
            return await self.app(scope, replay(body, receive), send)
        asked = {k: request.get(k) for k in ASKED}
        request["return_token_ids"] = True
        if "messages" in request:
            request["return_prompt_text"] = True
        new_body = json.dumps(request).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = dict(scope, headers=headers + [(b"content-length", str(len(new_body)).encode())])
        capture = Capture(scope["path"], {k: v for k, v in request.items() if k not in ASKED})
        await self.app(scope, replay(new_body, receive), Responder(send, capture, asked))


def replay(body: bytes, receive: Any) -> Any:
    """`receive` that hands over `body` first, then whatever the client sends next (its disconnect)."""
    sent = False

    async def inner() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return inner


class Responder:
    """`send` for one recorded request: reads (and strips) a JSON body whole, or an event stream event by event."""

    def __init__(self, send: Any, capture: Capture, asked: dict[str, Any]) -> None:
        self.send, self.capture, self.asked = send, capture, asked
        self.start: dict[str, Any] | None = None
        self.stream = False
        self.ok = False
        self.buffer = b""

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.ok = message.get("status") == 200
            ctype = dict((k.lower(), v) for k, v in message.get("headers", [])).get(b"content-type", b"")
            self.stream = ctype.startswith(b"text/event-stream")
            if not self.ok or self.stream:
                return await self.send(message)
            self.start = message  # a whole JSON body: its length changes once stripped, so it goes with the body
            return None
        if message["type"] != "http.response.body" or not self.ok:
            return await self.send(message)
        more = message.get("more_body", False)
        if self.stream:
            self.buffer += message.get("body", b"")
            events, _, self.buffer = self.buffer.rpartition(b"\n\n")
            out = b"".join(self.event(e) + b"\n\n" for e in events.split(b"\n\n")) if events else b""
            if not more:
                out += self.buffer
                self.finish()
            return await self.send({"type": "http.response.body", "body": out, "more_body": more})
        self.buffer += message.get("body", b"")
        if more:
            return None
        body = self.buffer
        try:
            obj = json.loads(body)
            self.capture.read(obj, delta=False)
            self.finish()
            body = json.dumps(strip(obj, self.asked), ensure_ascii=False, separators=(",", ":")).encode()
        except (ValueError, AttributeError, TypeError):
            pass
        assert self.start is not None
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        await self.send(dict(self.start, headers=headers + [(b"content-length", str(len(body)).encode())]))
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    def event(self, raw: bytes) -> bytes:
        """One server-sent event: its JSON read, then sent on stripped."""
        if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
            return raw
        try:
            obj = json.loads(raw[6:])
        except ValueError:
            return raw
        if not isinstance(obj, dict) or "choices" not in obj:
            return raw
        self.capture.read(obj, delta=True)
        return b"data: " + json.dumps(strip(obj, self.asked), ensure_ascii=False, separators=(",", ":")).encode()

    def finish(self) -> None:
        record = self.capture.record()
        if record is None:
            return
        try:
            append(record)
        except OSError as e:  # a full disk: the client still gets its answer; the server's log says what was lost
            print(f"specdraft: request {record.get('id')} not recorded in {record_path()}: {e}", file=sys.stderr,
                  flush=True)


def tensors(folder: str) -> dict[str, Any]:
    """name -> [kind, shape] of every tensor in the folder's .safetensors files (their headers only); the kind is
    "float" for every floating dtype (vLLM casts a float32 export to the dtype it serves in as it loads)."""
    out: dict[str, Any] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        out.update({k: ["float" if v["dtype"] in ("F64", "F32", "F16", "BF16") else v["dtype"], v["shape"]]
                    for k, v in header.items() if k != "__metadata__"})
    return out


def differences(old: str, new: str) -> list[str]:
    """What would keep `new` from loading into the drafter vLLM built from `old`: its config's structure, its tensors'
    names, kinds and shapes."""
    if not os.path.isfile(os.path.join(new, "config.json")):
        return [f"{new} has no config.json"]
    with open(os.path.join(old, "config.json"), encoding="utf-8") as f:
        a = json.load(f)
    with open(os.path.join(new, "config.json"), encoding="utf-8") as f:
        b = json.load(f)
    keys = [k for k in STRUCTURE if a.get(k) != b.get(k)]
    out = [f"config.json differs in {', '.join(keys)}"] if keys else []
    ta, tb = tensors(old), tensors(new)
    if not tb:
        return out + [f"{new} holds no .safetensors file"]
    names = sorted(k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k))
    out += [f"tensor {k}: {ta.get(k) or 'none'} served, {tb.get(k) or 'none'} given" for k in names[:3]]
    if len(names) > 3:
        out.append(f"{len(names) - 3} more tensors differ")
    return out


async def reload_drafter(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Load the drafter weights of the export folder named in the body into the running engine."""
    async def answer(status: int, obj: dict[str, Any]) -> None:
        body = json.dumps(obj).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    key = os.environ.get("VLLM_API_KEY")
    given = dict((k.lower(), v) for k, v in scope.get("headers", [])).get(b"authorization", b"").decode()
    if key and not hmac.compare_digest(given, f"Bearer {key}"):
        return await answer(401, {"error": "Unauthorized"})
    if os.environ.get("SPECDRAFT_RELOAD") != "1":
        return await answer(404, {"error": "this server was not started to reload its drafter"})
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return
        body += message.get("body", b"")
        more = message.get("more_body", False)
    try:
        path = json.loads(body)["path"]
        assert isinstance(path, str)
    except (ValueError, KeyError, TypeError, AssertionError):
        return await answer(400, {"error": 'give {"path": "<the drafter folder vLLM loads>"}'})
    served = os.environ["SPECDRAFT_DRAFTER_DIR"]
    if not os.path.isdir(path):
        return await answer(400, {"error": f"{path} is not a folder on the server's machine"})
    if diff := differences(served, path):
        return await answer(409, {"error": f"{path} is not the drafter this server built from {served}, so its "
                                           f"weights cannot be loaded in place: " + "; ".join(diff[:6]) +
                                           ". Serve it with a restart (python -m serve EXPORT)."})
    engine = scope["app"].state.engine_client
    started = time.perf_counter()
    try:
        results = await engine.collective_rpc("reload_drafter", args=(path,))
        # Cached prefixes hold the old drafter's keys and values. vLLM clears them only between requests (False while
        # one runs): ask again for a few seconds, then say whether it was done.
        cleared = await engine.reset_prefix_cache()
        deadline = time.monotonic() + 10
        while not cleared and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            cleared = await engine.reset_prefix_cache()
    except Exception as e:  # the engine's own message, to the caller that asked
        return await answer(500, {"error": f"{type(e).__name__}: {e}"})
    os.environ["SPECDRAFT_DRAFTER_DIR"] = path
    return await answer(200, {"results": results, "seconds": time.perf_counter() - started, "served": path,
                              "prefix_cache_reset": cleared})
