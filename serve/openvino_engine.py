"""OpenVINO GenAI, driven from the project: openvino-genai and optimum-intel pin transformers below this project's, so
they live in their own virtualenv (scripts/setup_openvino.sh) and a call hands a JSON request to that interpreter
running serve/openvino_worker.py (one process per call: importing OpenVINO takes under a second) and reads its JSON
result.

- `convert(export, out, verifier_checkpoint)`: an export -> the folder OpenVINO GenAI loads: `verifier/` (the
  verifier as OpenVINO IR, through optimum-intel) and `draft/` (an EAGLE-3 export through its SpecForge layout and
  optimum-intel), with the feature layers set in OpenVINO's convention, then `check_contract` on what was written.
- `serve(folder, prompts, ...)`: LLMPipeline plain, with the draft, or with OpenVINO's prompt lookup, on token-id
  prompts at batch 1; `serve_many` runs several of those interleaved prompt by prompt.

The feature-layer convention. This project names a feature layer by the layer whose *input* it is (Hugging Face's
`hidden_states[i]`: i = 0 is the embeddings), as vLLM's `eagle_aux_hidden_state_layer_ids` do. OpenVINO GenAI names
it by the decoder layer whose *output* it is (the residual Add that ends `layers.i`), so our i is its i - 1; it reads
the ids from the draft IR's runtime info `hidden_layers_list` (draft_model() in openvino_genai), and without them takes
2, L/2, L-3, which on a 30-layer verifier are our ids unshifted: a drafter fed the layers one below its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.families import FAMILIES
from runtime.errors import UserError

VERSION = "2026.4.1"
WORKER = Path(__file__).with_name("openvino_worker.py")
MANIFEST = "specdraft-openvino.json"
WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")
PRECISIONS = {"float32": "f32", "bfloat16": "bf16", "f32": "f32", "bf16": "bf16"}


def modes() -> dict[str, str]:
    """Families OpenVINO GenAI drafts with, and its mode for each (models/families.py `openvino`)."""
    return {n: f.openvino for n, f in FAMILIES.items() if f.openvino is not None}


def check_family(kind: str | None) -> str:
    """OpenVINO GenAI's mode for an export of `kind`, refusing a family it lacks."""
    if kind not in modes():
        raise UserError(f"OpenVINO GenAI {VERSION} does not draft with {kind or 'this'} exports: its speculative "
                        f"decoding takes an EAGLE-3 draft (eagle3_mode), a plain draft model or its own prompt "
                        f"lookup, and has no Medusa heads, EAGLE-1, parallel (P-EAGLE) or block (DFlash on this "
                        f"verifier) drafter. Convert one of {sorted(modes())}, or serve this export with vLLM "
                        f"(engine_peers=[vllm]).")
    return modes()[kind]  # type: ignore[index]


def venv_dir() -> Path:
    return Path(os.environ.get("SPECDRAFT_OPENVINO_VENV", "~/.cache/specdraft/openvino-venv")).expanduser()


def openvino_python() -> Path:
    """The OpenVINO virtualenv's interpreter, refusing a missing or unfinished one."""
    python = venv_dir() / "bin" / "python"
    if not python.is_file() or not any(venv_dir().glob(f".specdraft-openvino-{VERSION}*")):
        raise UserError(f"no OpenVINO GenAI {VERSION} virtualenv at {venv_dir()}: run `bash "
                        f"scripts/setup_openvino.sh` (setup.sh does) to build it, or point SPECDRAFT_OPENVINO_VENV at "
                        f"one it built.")
    return python


def _call(request: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """One request to serve/openvino_worker.py in the OpenVINO interpreter, under the watchdog (it goes when this
    process goes); its failure raised as an EngineError with the worker's traceback and log."""
    from runtime.lifetime import watched

    python = openvino_python()
    env = dict(os.environ) | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # this project's packages stay out of the other interpreter
    with tempfile.TemporaryDirectory(prefix="specdraft-openvino-") as tmp:
        req, res, log = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "worker.log"
        req.write_text(json.dumps(request))
        with open(log, "wb") as out:
            proc = subprocess.Popen(watched([str(python), str(WORKER), str(req), str(res)]), stdout=out,
                                    stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                raise UserError(f"OpenVINO's worker did not finish {request['op']} within {timeout:.0f} s.") from None
        text = log.read_text(errors="replace")
        if not res.is_file():
            raise EngineError(request["op"], f"its process ended with exit code {code}", text)
        out_json: dict[str, Any] = json.loads(res.read_text())
    if "error" in out_json:
        raise EngineError(request["op"], out_json["error"], f"{text}\n{out_json.get('traceback', '')}")
    return out_json


class EngineError(UserError):
    """OpenVINO (or optimum-intel) failed: its error first, then the last lines of the worker's log."""

    def __init__(self, op: str, cause: str, log: str) -> None:
        tail = "\n".join([ln for ln in log.splitlines() if ln.strip()][-15:])
        self.cause, self.log = cause, log
        super().__init__(f"OpenVINO failed ({op}): {cause}\n--- last lines of its log ---\n{tail}")


# ----------------------------------------------------------------------------------------------------- conversion


def openvino_layers(ids: Sequence[int], num_layers: int) -> list[int]:
    """Our feature-layer ids (layer inputs; 0: the embeddings) -> OpenVINO GenAI's (layer outputs), refusing what it
    cannot take: the embeddings (no layer outputs them), a layer past the verifier's last."""
    ids = [int(i) for i in ids]
    if len(ids) != 3:
        raise UserError(f"feature layers {ids}: OpenVINO GenAI's EAGLE-3 takes exactly three; retrain with three "
                        f"(model.aux_layer_ids) or serve this export with vLLM.")
    bad = [i for i in ids if not 1 <= i <= num_layers]
    if bad:
        raise UserError(f"feature layers {ids}: {bad} cannot be given to OpenVINO GenAI, which takes the outputs of "
                        f"decoder layers 0..{num_layers - 1} (our ids 1..{num_layers}; 0 is the embeddings); retrain "
                        f"with layers in that range, or serve this export with vLLM.")
    return [i - 1 for i in ids]


def export_verifier(checkpoint: str | Path, out: str | Path, weight_format: str = "fp32") -> Path:
    """A Hugging Face checkpoint folder -> OpenVINO IR (with its tokenizer as OpenVINO tokenizer models) in `out`,
    through optimum-intel, its weights stored as `weight_format` (fp32, fp16, or int8 / int4 weight compression)."""
    if weight_format not in WEIGHT_FORMATS:
        raise UserError(f"weight format {weight_format!r}: OpenVINO's export takes one of {list(WEIGHT_FORMATS)}.")
    checkpoint = Path(checkpoint).expanduser()
    if not (checkpoint / "config.json").is_file():
        raise UserError(f"verifier checkpoint {checkpoint}: no config.json there; give the Hugging Face folder the "
                        f"export was trained on (--verifier), or run `python -m eval` once to cache the embedded one.")
    _call({"op": "export", "source": str(checkpoint), "out": str(out), "weight_format": weight_format})
    return Path(out)


def expected_contract(export_dir: Path) -> dict[str, Any]:
    """What OpenVINO must read back for this export: its feature layers in OpenVINO's convention, d2t, the draft
    vocabulary, fc's input width, the verifier's vocabulary; refusing norms OpenVINO's draft layer lacks."""
    from models.exports.io import export_kind, read_config, read_weights

    config = read_config(export_dir)
    kind = export_kind(config)
    check_family(kind)
    for flag in ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc"):
        if config.get(flag):
            raise UserError(f"{export_dir}: {flag}=true (EAGLE-3.1's options and the other norm placements); "
                            f"OpenVINO's EAGLE-3 draft layer (optimum-intel's LlamaEagle3) has no such norm and "
                            f"would draft from other features. Retrain without it, or serve this export with vLLM.")
    fp = config.get("verifier_fingerprint") or {}
    layers = int(fp.get("num_hidden_layers") or config.get("verifier_num_hidden_layers"))
    ids = config.get("eagle_aux_hidden_state_layer_ids") or []
    tensors = read_weights(export_dir)
    d2t = tensors.get("d2t")
    return {"kind": kind, "feature_layers": [int(i) for i in ids], "hidden_layers_list": openvino_layers(ids, layers),
            "num_layers": layers, "hidden_size": int(fp.get("hidden_size") or config["hidden_size"]),
            "vocab": int(fp.get("vocab_size") or config["vocab_size"]),
            "draft_vocab": int(config.get("draft_vocab_size") or config["vocab_size"]),
            "d2t": None if d2t is None else [int(x) for x in d2t.tolist()]}


def convert(export_dir: str | Path, out: str | Path, verifier_checkpoint: str | Path, weight_format: str = "fp32",
            force: bool = False, verifier_ir: str | Path | None = None) -> Path:
    """An export -> `out/verifier` (the verifier's IR) and `out/draft` (the drafter's, its feature layers in
    OpenVINO's convention) and `out/specdraft-openvino.json`, written whole, then checked (check_contract).
    `verifier_ir`: an IR of the same verifier already converted, copied instead of converting again."""
    from models.exports.io import to_reference
    from runtime.io import atomic_dir

    export_dir, out = Path(export_dir).expanduser(), Path(out).expanduser()
    expected = expected_contract(export_dir)  # refusals before anything converts
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file() and not force:
        raise UserError(f"{out} holds files that are not an OpenVINO conversion of this project; give an empty or "
                        f"new folder, or --force to replace it (all of it is deleted).")
    openvino_python()
    with atomic_dir(out) as tmp:
        ref = to_reference(None, export_dir, tmp / "reference")
        if verifier_ir is not None:  # linked, not copied: the same files, read only
            shutil.copytree(verifier_ir, tmp / "verifier", copy_function=_link)
        else:
            export_verifier(verifier_checkpoint, tmp / "verifier", weight_format)
        _call({"op": "export", "source": str(ref), "out": str(tmp / "draft"), "weight_format": "fp32", "draft": True,
               "tokenizer_from": str(tmp / "verifier"), "hidden_layers": expected["hidden_layers_list"]})
        shutil.rmtree(ref)
        manifest = {"export": str(export_dir.resolve()), "verifier_checkpoint": str(verifier_checkpoint),
                    "weight_format": weight_format, "openvino_genai": VERSION, "mode": expected["kind"],
                    "feature_layers": expected["feature_layers"],
                    "hidden_layers_list": expected["hidden_layers_list"],
                    "convention": "hidden_layers_list: OpenVINO GenAI's, the outputs of decoder layers (ours - 1)"}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        check_contract(tmp, export_dir, expected, shown=out)
    return out


def set_feature_layers(draft: str | Path, ids: Sequence[int]) -> None:
    """Write `ids` as the draft IR's `hidden_layers_list` (OpenVINO's convention: decoder layer outputs), as
    `convert` does last; the IR is written whole beside and moved over the old one (links to it keep the old)."""
    _call({"op": "layers", "draft": str(Path(draft).expanduser()), "hidden_layers": [int(i) for i in ids]})


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def _cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft")).expanduser() / "openvino"


def _digest(*parts: bytes) -> str:
    import hashlib

    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]


def converted_verifier(checkpoint: str | Path, cache_dir: str | None = None, weight_format: str = "fp32") -> Path:
    """The verifier's IR, converted once under <cache>/openvino/verifiers/<name>-<hash>-<format>."""
    from runtime.io import atomic_dir

    checkpoint = Path(checkpoint).expanduser()
    key = _digest(str(checkpoint.resolve()).encode(), (checkpoint / "config.json").read_bytes())
    folder = _cache_root(cache_dir) / "verifiers" / f"{checkpoint.name}-{key}-{weight_format}"
    if not (folder / "openvino_model.xml").is_file():
        with atomic_dir(folder) as tmp:
            export_verifier(checkpoint, tmp / "ir", weight_format)
            for f in (tmp / "ir").iterdir():
                f.replace(tmp / f.name)
            (tmp / "ir").rmdir()
    return folder


def converted_folder(export_dir: str | Path, checkpoint: str | Path, cache_dir: str | None = None,
                     weight_format: str = "fp32") -> Path:
    """An export converted once (`convert`) under <cache>/openvino/<export name>-<hash>, keyed by its config,
    its weights' size and time and the verifier checkpoint; the verifier IR linked from converted_verifier."""
    export_dir = Path(export_dir).expanduser().resolve()
    stats = b"".join(str(f.stat().st_size).encode() + str(f.stat().st_mtime_ns).encode()
                     for f in sorted(export_dir.glob("*.safetensors")))
    key = _digest((export_dir / "config.json").read_bytes(), stats, str(checkpoint).encode(), weight_format.encode())
    folder = _cache_root(cache_dir) / f"{export_dir.name}-{key}"
    if not (folder / MANIFEST).is_file():
        convert(export_dir, folder, checkpoint, weight_format, force=True,
                verifier_ir=converted_verifier(checkpoint, cache_dir, weight_format))
    return folder


def inspect(folder: str | Path) -> dict[str, Any]:
    """What OpenVINO GenAI reads from a converted folder (serve/openvino_worker.py `inspect`)."""
    folder = Path(folder).expanduser()
    for part in ("verifier", "draft"):
        if not (folder / part / "openvino_model.xml").is_file():
            raise UserError(f"{folder}: no {part}/openvino_model.xml; write the folder with `python -m "
                            f"scripts.tools.convert openvino EXPORT {folder}`.")
    return _call({"op": "inspect", "draft": str(folder / "draft"), "verifier": str(folder / "verifier")})


def check_contract(folder: str | Path, export_dir: str | Path, expected: dict[str, Any] | None = None,
                   shown: str | Path | None = None) -> None:
    """Read back what OpenVINO GenAI will read from `folder` and compare it with the export: eagle3_mode, the
    feature layers in its convention (and that the verifier has them), d2t, the draft vocabulary, fc's input width
    and the verifier's vocabulary. A disagreement is refused, naming both sides and the fix (`shown`: the folder
    named in the message, where `folder` is its scratch copy being written)."""
    exp = expected or expected_contract(Path(export_dir).expanduser())
    got = inspect(folder)
    draft, verifier = got["draft"], got["verifier"]
    shown = shown or folder
    fix = f"convert again: `python -m scripts.tools.convert openvino {export_dir} {shown} --force`"
    problems = []
    if str(draft["eagle3_mode"]).lower() != "true":
        problems.append(f"the draft IR's eagle3_mode is {draft['eagle3_mode']!r}, not True (OpenVINO GenAI would "
                        f"run it as a plain draft model)")
    if draft["hidden_layers_list"] != exp["hidden_layers_list"]:
        problems.append(f"the draft IR's hidden_layers_list is {draft['hidden_layers_list']} (None: OpenVINO's "
                        f"default 2, L/2, L-3), the export's feature layers {exp['feature_layers']} (layer inputs) "
                        f"are {exp['hidden_layers_list']} in OpenVINO's convention (layer outputs)")
    missing = [i for i in exp["hidden_layers_list"] if i not in verifier["layers"]]
    if missing:
        problems.append(f"the verifier IR has no decoder layer {missing} (it has {len(verifier['layers'])})")
    if draft["draft_vocab"] != exp["draft_vocab"]:
        problems.append(f"the draft IR's vocabulary is {draft['draft_vocab']}, the export's {exp['draft_vocab']}")
    if exp["d2t"] is not None and draft["d2t"] != exp["d2t"]:
        problems.append("the draft IR's d2t table differs from the export's")
    if draft["fc_in"] != 3 * exp["hidden_size"]:
        problems.append(f"the draft IR's fc takes {draft['fc_in']} features, three of the verifier's hidden size "
                        f"{exp['hidden_size']} are {3 * exp['hidden_size']}")
    if verifier["vocab"] != exp["vocab"]:
        problems.append(f"the verifier IR's vocabulary is {verifier['vocab']}, the export's verifier's {exp['vocab']}")
    if problems:
        raise UserError(f"{shown} does not hold what OpenVINO GenAI must read for {export_dir}: "
                        + "; ".join(problems) + f". {fix}.")


# ------------------------------------------------------------------------------------------------------- serving


@dataclass
class EngineRun:
    """One OpenVINO GenAI configuration's run: outputs (new token ids per prompt), generation seconds (warm-up and
    load excluded), load seconds, and for a speculative one its counters (SDPerModelsPerfMetrics: accepted draft
    tokens, draft tokens offered, main-model inferences)."""

    name: str
    outputs: list[list[int]]
    seconds: float
    load_seconds: float
    accepted: int | None
    draft_tokens: int | None
    main_infers: int | None
    version: str

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def rounds(self) -> int | None:
        """Drafting rounds: the main model's inferences less each prompt's prefill."""
        return None if self.main_infers is None else self.main_infers - len(self.outputs)

    @property
    def accepted_per_round(self) -> float | None:
        return self.accepted / self.rounds if self.accepted is not None and self.rounds else None

    @property
    def tau(self) -> float | None:
        """Tokens per verifier forward, the bonus token counted: 1 + accepted drafts per round."""
        a = self.accepted_per_round
        return None if a is None else 1 + a

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens over draft tokens offered (OpenVINO's get_draft_acceptance_rate)."""
        return self.accepted / self.draft_tokens if self.accepted is not None and self.draft_tokens else None


def configuration(name: str, draft: str | Path | None = None, tokens: int = 3, lookup: bool = False,
                  ngram: int = 3) -> dict[str, Any]:
    """One pipeline serve_many runs: plain (no draft, no lookup), drafting `tokens` per step with the draft IR folder
    `draft`, or OpenVINO's prompt lookup (`lookup`, n-grams up to `ngram`) proposing `tokens`."""
    if draft is not None and lookup:
        raise UserError(f"configuration {name!r}: a draft model and prompt lookup together; OpenVINO GenAI runs one.")
    if (draft is not None or lookup) and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise UserError(f"configuration {name!r}: {tokens!r} tokens per step; give a whole number >= 1.")
    return {"name": name, "draft": None if draft is None else str(Path(draft).expanduser().resolve()),
            "tokens": int(tokens), "lookup": bool(lookup), "ngram": int(ngram)}


def serve_many(model: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               configs: Sequence[dict[str, Any]], precision: str = "bf16", threads: int | None = None,
               temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, warmup: bool = True,
               timeout: float = 1800) -> dict[str, EngineRun]:
    """Every configuration (`configuration(...)`) on `prompts` through OpenVINO GenAI's LLMPipeline over the
    verifier IR `model`, batch 1, interleaved prompt by prompt; `precision` is OpenVINO's inference precision
    (bf16 or f32, or the torch dtype names)."""
    model = Path(model).expanduser()
    if not (model / "openvino_model.xml").is_file():
        raise UserError(f"{model}: no openvino_model.xml; give the verifier/ folder `python -m scripts.tools.convert "
                        f"openvino` writes.")
    if precision not in PRECISIONS:
        raise UserError(f"precision {precision!r}: OpenVINO's CPU runs {sorted(set(PRECISIONS.values()))}.")
    for c in configs:
        if c.get("draft") and not (Path(c["draft"]) / "openvino_model.xml").is_file():
            raise UserError(f"{c['draft']}: no openvino_model.xml; give the draft/ folder `python -m "
                            f"scripts.tools.convert openvino` writes.")
    out = _call({"op": "generate", "model": str(model), "configs": list(configs),
                 "prompts": [[int(t) for t in p] for p in prompts], "max_new_tokens": int(max_new_tokens),
                 "precision": PRECISIONS[precision], "threads": threads, "temperature": float(temperature),
                 "top_p": float(top_p), "seed": int(seed), "warmup": bool(warmup)}, timeout)
    runs = {}
    for name, r in out["runs"].items():
        counted = r["counted"]
        runs[name] = EngineRun(name, r["outputs"], r["seconds"], r["load_seconds"],
                               r["accepted"] if counted else None, r["draft_tokens"] if counted else None,
                               r["main_infers"] if counted else None, out["version"])
    return runs


def serve(folder: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, draft: bool = False,
          lookup: bool = False, tokens: int = 3, **kwargs: Any) -> EngineRun:
    """One configuration on a converted folder (`convert`): plain, drafting `tokens` per step with its draft, or
    OpenVINO's prompt lookup; `kwargs`: serve_many's."""
    folder = Path(folder).expanduser()
    config = configuration("run", folder / "draft" if draft else None, tokens, lookup)
    return serve_many(folder / "verifier", prompts, max_new_tokens, [config], **kwargs)["run"]
