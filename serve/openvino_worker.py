"""Runs inside the OpenVINO virtualenv (scripts/setup_openvino.sh), never imported by the project: one JSON request
in (argv[1]), one JSON result out (argv[2]). serve/openvino_engine.py writes the request and reads the result.

Four operations:
- "export": a Hugging Face folder -> OpenVINO IR through optimum-intel (the verifier, or an EAGLE-3 draft in the
  SpecForge layout); for a draft, the feature layers OpenVINO GenAI takes are written into the IR's runtime info
  (`hidden_layers_list`), as its draft_model() reads them (without them it uses 2, L/2, L-3).
- "layers": a draft IR's `hidden_layers_list` written anew (export's last step, alone).
- "inspect": what OpenVINO GenAI will read from a converted folder: the draft IR's runtime info, its inputs and
  outputs, its d2t table, fc's input width, and the verifier IR's layers and vocabulary.
- "generate": LLMPipeline runs, plain, with a draft model, or with its prompt lookup, on token-id prompts at batch
  1, interleaved prompt by prompt (every configuration answers prompt 1, then prompt 2...), so a ratio of their
  times is fair on a shared machine. Each configuration is warmed up once on the first prompt first.

Standard library, openvino, openvino_genai and optimum only.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

EXCLUDED = ("openvino_model.xml", "openvino_model.bin")


def export(req: dict[str, Any]) -> dict[str, Any]:
    from optimum.exporters.openvino import main_export
    from optimum.intel import OVConfig, OVWeightQuantizationConfig

    src, out = req["source"], Path(req["out"])
    fmt = req.get("weight_format", "fp32")
    if fmt in ("int8", "int4"):  # weight-only compression, as `optimum-cli export openvino --weight-format` does
        config = OVConfig(quantization_config=OVWeightQuantizationConfig(bits=8 if fmt == "int8" else 4))
    else:
        config = OVConfig(dtype=fmt)
    kwargs: dict[str, Any] = {"ov_config": config}
    main_export(src, out, task="text-generation-with-past", trust_remote_code=bool(req.get("draft")),
                local_files_only=True, **kwargs)
    if req.get("tokenizer_from"):  # a draft's folder carries its verifier's tokenizer (draft_model() reads one)
        for f in Path(req["tokenizer_from"]).iterdir():
            if f.name.startswith("openvino_") and f.name not in EXCLUDED and not (out / f.name).exists():
                shutil.copy(f, out / f.name)
    if req.get("hidden_layers") is not None:
        set_layers(out, [int(i) for i in req["hidden_layers"]])
    return {"out": str(out)}


def set_layers(folder: Path, ids: list[int]) -> None:
    """The draft IR with `hidden_layers_list` in its runtime info, written whole beside and moved over it."""
    import openvino as ov

    model = ov.Core().read_model(str(folder / "openvino_model.xml"))
    model.set_rt_info(ids, ["hidden_layers_list"])
    tmp = folder / "rewrite"
    tmp.mkdir(exist_ok=True)
    ov.save_model(model, str(tmp / "openvino_model.xml"), compress_to_fp16=False)
    del model
    for name in EXCLUDED:
        (tmp / name).replace(folder / name)
    tmp.rmdir()


def _rt(model: Any, key: str) -> str | None:
    return str(model.get_rt_info(key).astype(str)) if model.has_rt_info(key) else None


def inspect(req: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import openvino as ov

    core, out = ov.Core(), {}
    if req.get("draft"):
        m = core.read_model(str(Path(req["draft"]) / "openvino_model.xml"))
        layers = _rt(m, "hidden_layers_list")
        d2t, fc_in = None, None
        for r in m.get_results():
            node = r.input_value(0).get_node()
            if "d2t" in r.get_output_tensor(0).get_names() or "d2t" in node.get_friendly_name():
                d2t = np.asarray(node.get_data() if hasattr(node, "get_data") else node.data).astype(int).tolist()
        for op in m.get_ordered_ops():  # fc: the MatMul fed by the hidden_states parameter; its weight's width
            if op.get_type_name() == "MatMul" and "hidden_states" in op.input_value(0).get_node().get_friendly_name():
                w = op.input_value(1).get_partial_shape()
                fc_in = int(w[-1 if op.get_attributes()["transpose_b"] else -2].get_length())
        out["draft"] = {
            "eagle3_mode": _rt(m, "eagle3_mode"),
            "hidden_layers_list": [int(x) for x in layers.split()] if layers else None,
            "inputs": {i.get_any_name(): str(i.get_partial_shape()) for i in m.inputs},
            "draft_vocab": int(m.output("logits").get_partial_shape()[-1].get_length()),
            "d2t": d2t, "fc_in": fc_in,
        }
    if req.get("verifier"):
        m = core.read_model(str(Path(req["verifier"]) / "openvino_model.xml"))
        pat = re.compile(r"layers\.(\d+)/")
        layers = {int(g) for op in m.get_ordered_ops() for g in pat.findall(op.get_friendly_name())}
        out["verifier"] = {"layers": sorted(layers),
                           "vocab": int(m.output("logits").get_partial_shape()[-1].get_length())}
    return out


def _config(genai: Any, c: dict[str, Any], req: dict[str, Any]) -> Any:
    cfg = genai.GenerationConfig()
    cfg.max_new_tokens = int(req["max_new_tokens"])
    if req["temperature"] > 0:
        cfg.do_sample, cfg.temperature, cfg.top_p = True, float(req["temperature"]), float(req["top_p"])
        cfg.rng_seed = int(req["seed"])
    else:
        cfg.do_sample = False
    if c.get("draft") or c.get("lookup"):
        cfg.num_assistant_tokens = int(c["tokens"])
    if c.get("lookup"):
        cfg.max_ngram_size = int(c.get("ngram", 3))
    return cfg


def generate(req: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    props = {"INFERENCE_PRECISION_HINT": req["precision"]}
    if req.get("threads"):
        props["INFERENCE_NUM_THREADS"] = int(req["threads"])
    pipes, runs = {}, {}
    for c in req["configs"]:
        extra: dict[str, Any] = {}
        if c.get("draft"):
            extra["draft_model"] = genai.draft_model(c["draft"], "CPU", **props)
        if c.get("lookup"):
            extra["prompt_lookup"] = True
        t = time.perf_counter()
        pipes[c["name"]] = genai.LLMPipeline(req["model"], "CPU", **props, **extra)
        runs[c["name"]] = {"outputs": [], "seconds": 0.0, "load_seconds": time.perf_counter() - t, "accepted": 0,
                           "draft_tokens": 0, "main_infers": 0, "counted": False}
    prompts = [ov.Tensor(np.array([p], dtype=np.int64)) for p in req["prompts"]]
    if req.get("warmup", True) and prompts:
        for c in req["configs"]:
            pipes[c["name"]].generate(prompts[0], _config(genai, c, req))
    for ids in prompts:
        for c in req["configs"]:
            run, cfg = runs[c["name"]], _config(genai, c, req)
            t = time.perf_counter()
            res = pipes[c["name"]].generate(ids, cfg)
            run["seconds"] += time.perf_counter() - t
            run["outputs"].append([int(x) for x in res.tokens[0]])
            sd = res.extended_perf_metrics
            if sd is not None and hasattr(sd, "get_num_accepted_tokens"):  # SDPerModelsPerfMetrics
                run["counted"] = True
                run["accepted"] += int(sd.get_num_accepted_tokens())
                run["draft_tokens"] += int(sd.get_num_draft_tokens())
                run["main_infers"] += len(sd.main_model_metrics.raw_metrics.m_durations)
    return {"runs": runs, "version": genai.get_version(), "openvino": ov.get_version()}


def layers(req: dict[str, Any]) -> dict[str, Any]:
    set_layers(Path(req["draft"]), [int(i) for i in req["hidden_layers"]])
    return {"draft": req["draft"]}


OPS = {"export": export, "inspect": inspect, "generate": generate, "layers": layers}


def main() -> int:
    req = json.loads(Path(sys.argv[1]).read_text())
    try:
        out = OPS[req["op"]](req)
    except Exception as e:  # the driver raises it as a UserError with this text
        out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    Path(sys.argv[2]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
