"""The evaluation harness behind `python -m eval`: load an export and its verifier, then decode every prompt with
four methods, interleaved in one process so that they share the machine's state:

- `baseline`: our plain greedy decoding (plain sampling when temperature > 0), one verifier forward per token,
  through the same cache code;
- `speculative`: speculative decoding with the exported drafter over the configured chain or tree, greedy or
  sampled (eval.sampling: exact rejection sampling, or Medusa's lossy typical acceptance when typical=true);
- `hf_generate`: Hugging Face `model.generate`, greedy or sampled alike, as an outside reference;
- `hf_prompt_lookup`: the same with `prompt_lookup_num_tokens`, HF's own drafter-free speculation;
- `hf_assisted` (drafter=draft_model only): HF assisted generation with the same draft model as `assistant_model`
  and a constant `num_assistant_tokens` = its depth.

Each prompt yields one `Sample`; eval.report turns samples into report.json, profile.json, a table, plots and a W&B
run. `evaluate(cfg)` is the whole command.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor
from tqdm import tqdm
from transformers import GenerationConfig

from data.chat import prompt_ids
from data.prompts import Conversation, load_conversations, select_prompts
from eval import cost
from eval.decode import ENGINES, DecodeResult, engine_of, sample_decode, speculative_decode, use_engine
from eval.drafters import Drafter
from eval.families import NEEDS_EXPORT, method_name
from eval.peers import check_peers, vllm_peer
from eval.sampling import SamplingConfig
from hydra.utils import instantiate
from eval.report import Sample, write_outputs
from models.draft_model import read_draft_info
from models.errors import UserError, VerifierMismatchError
from models.export import export_kind, export_verifier, read_config
from models.verifier import Verifier, load_verifier

EVAL_DTYPES = ("float32", "bfloat16")
EXPORT_KINDS = ("medusa", "eagle", "eagle3")  # the families whose export carries acceptance estimates


def check_length(verifier: Verifier, ids: list[int], max_new_tokens: int, where: str) -> None:
    """Refuse a prompt that does not leave room for max_new_tokens in the verifier's context window."""
    window = getattr(verifier.config, "max_position_embeddings", None)
    if window is not None and max_new_tokens >= window:
        raise UserError(f"max_new_tokens={max_new_tokens} does not fit the verifier's context window of {window} "
                        f"tokens, prompt included; lower max_new_tokens well below {window}.")
    if window is not None and len(ids) > window - max_new_tokens:
        raise UserError(
            f"{where} is {len(ids)} tokens after the chat template; with max_new_tokens={max_new_tokens} the "
            f"verifier's context window of {window} allows at most {window - max_new_tokens}. Shorten or drop that "
            f"prompt, or lower max_new_tokens."
        )


def assistant_of(drafter: Drafter) -> tuple[Any | None, int]:
    """The draft model HF assisted generation can use as `assistant_model` and its depth, or (None, 0) for a drafter
    that is no draft model."""
    from eval.draft_model import DraftModelDrafter

    return (drafter.model, drafter.depth) if isinstance(drafter, DraftModelDrafter) else (None, 0)


class Runner:
    """Decodes one prompt with every method and times each (wall clock around the whole call, so that our loops and
    HF's are measured the same way). With `assistant` (a draft model), HF assisted generation joins the references,
    proposing a constant `assistant_tokens` per round."""

    def __init__(self, verifier: Verifier, drafter: Drafter, max_new_tokens: int, lookup: int,
                 sampling: SamplingConfig | None = None, seed: int = 0, engine: str = "auto",
                 assistant: Any | None = None, assistant_tokens: int = 4) -> None:
        self.verifier, self.drafter, self.max_new, self.engine = verifier, drafter, max_new_tokens, engine
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.generator = torch.Generator(verifier.device).manual_seed(seed)
        gen_eos = verifier.model.generation_config.eos_token_id
        eos = {verifier.tokenizer.eos_token_id} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos = sorted(e for e in eos if e is not None)
        # Every field that could change greedy output is set here, so the checkpoint's generation_config.json
        # (which fills unset fields) cannot leak a repetition penalty or a sampling default into the reference.
        s = self.sampling
        sample = dict(do_sample=False) if s is None else dict(do_sample=True, temperature=s.temperature,
                                                              top_p=s.top_p, top_k=s.top_k)
        common = dict(
            max_new_tokens=max_new_tokens, **sample, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0,
            min_new_tokens=0, eos_token_id=self.eos, pad_token_id=verifier.tokenizer.pad_token_id, use_cache=True,
        )
        self.hf_config = GenerationConfig(**common)
        self.lookup_config = GenerationConfig(**common, prompt_lookup_num_tokens=lookup)
        self.assistant = assistant
        if assistant is not None:
            # A constant number of drafts (HF's default schedule adapts it) and no early stop on confidence: the
            # chain our draft-model drafter proposes. HF reads these from the assistant's own generation_config
            # (set on the config passed to generate, they are silently ignored).
            assistant.generation_config.update(num_assistant_tokens=assistant_tokens,
                                               num_assistant_tokens_schedule="constant",
                                               assistant_confidence_threshold=0.0)

    def _sync(self) -> None:
        if self.verifier.device.type == "cuda":
            torch.cuda.synchronize()

    def _hf(self, ids: Tensor, config: GenerationConfig) -> list[int]:
        out = self.verifier.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out[0, ids.shape[1]:].tolist()

    def _assisted(self, ids: Tensor) -> list[int]:
        out = self.verifier.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=self.assistant,
                                           generation_config=self.hf_config)
        return out[0, ids.shape[1]:].tolist()

    def decode(self, ids: list[int], prompt_id: str = "", category: str = "", turn: int = 0) -> Sample:
        """Every method on one prompt, in a fixed interleaved order."""
        x = torch.tensor([ids], device=self.verifier.device)  # (1, T)
        seconds, outputs, results = {}, {}, {}
        v, n = self.verifier, self.max_new
        calls = {
            "baseline": lambda: sample_decode(v, x, n, self.eos, self.sampling, self.generator, engine=self.engine),
            "speculative": lambda: speculative_decode(v, self.drafter, x, n, self.eos, self.sampling, self.generator,
                                                      engine=self.engine),
            "hf_generate": lambda: self._hf(x, self.hf_config),
            "hf_prompt_lookup": lambda: self._hf(x, self.lookup_config),
        }
        if self.assistant is not None:
            calls["hf_assisted"] = lambda: self._assisted(x)
        for method, call in calls.items():
            self._sync()
            start = time.perf_counter()
            out = call()
            self._sync()
            seconds[method] = time.perf_counter() - start
            if isinstance(out, DecodeResult):
                results[method], outputs[method] = out, out.tokens[0].tolist()
            else:
                outputs[method] = out
        spec, base = results["speculative"], results["baseline"]
        return Sample(
            id=prompt_id, category=category, turn=turn, prompt_tokens=len(ids), seconds=seconds, outputs=outputs,
            accept_lengths=spec.accept_lengths[:, 0].cpu(),
            forwards={"baseline": base.num_forwards, "speculative": spec.num_forwards},
            times={"baseline": base.times, "speculative": spec.times},
        )


def _turns(conv: Conversation) -> list[list[dict[str, str]]]:
    """The history before each user turn's answer: system and user messages so far, the source's own assistant
    turns left out (the verifier's answers replace them as they are decoded)."""
    history, out = [], []
    for message in conv.messages:
        if message["role"] != "assistant":
            history.append(message)
            if message["role"] == "user":
                out.append(list(history))
    return out


def run_prompts(
    runner: Runner, convs: Sequence[Conversation], multi_turn: bool, warmup: bool = True, progress: bool = True
) -> list[Sample]:
    """Decode every conversation's first user turn (or, with multi_turn, every turn with the verifier's own greedy
    answers as history, each turn a separate measured decode)."""
    tok, samples = runner.verifier.tokenizer, []
    first = [prompt_ids(tok, _turns(c)[0]) for c in convs]
    for conv, ids in zip(convs, first):  # fail before minutes of decoding, not in the middle
        check_length(runner.verifier, ids, runner.max_new, f"prompt {conv.id!r}")
    if warmup and first:
        # Uncounted: the first calls pay for lazy initialisation (kernels, allocator, HF's generation setup).
        runner.decode(first[0])
    total = sum(len(_turns(c)) if multi_turn else 1 for c in convs)
    with tqdm(total=total, desc="eval", unit="prompt", disable=not progress) as bar:
        for conv in convs:
            answers: list[dict[str, str]] = []  # the verifier's own answers so far, one per earlier turn
            for turn, history in enumerate(_turns(conv)[: None if multi_turn else 1], start=1):
                messages = _interleave(history, answers)
                ids = prompt_ids(tok, messages)
                check_length(runner.verifier, ids, runner.max_new, f"prompt {conv.id!r}, turn {turn}")
                sample = runner.decode(ids, conv.id, conv.category, turn)
                samples.append(sample)
                bar.update(1)
                answer = tok.decode(sample.outputs["baseline"], skip_special_tokens=True)
                answers.append({"role": "assistant", "content": answer})
    return samples


def _interleave(history: list[dict[str, str]], answers: list[dict[str, str]]) -> list[dict[str, str]]:
    """Put answer i right after the i-th user message of `history`."""
    out, i = [], 0
    for message in history:
        out.append(message)
        if message["role"] == "user" and i < len(answers):
            out.append(answers[i])
            i += 1
    return out


@dataclass
class Setup:
    """What a run decodes with: the verifier, the drafter (which owns its tree) and the prompts."""

    verifier: Verifier
    drafter: Drafter
    method: str
    convs: list[Conversation]
    curves: list[cost.Curve] = field(default_factory=list)  # the verifier's cost curves (profile=true, size=auto)
    predicted: cost.Plan | None = None  # what the first curve predicts for this drafter
    auto_size: bool = False
    draft_curve: list[float] | None = None  # ms of one round's drafting at the first curve's sizes


def verifier_source_of(cfg: DictConfig, export: Path | None) -> Any:
    """verifier_path when given, else the verifier the export names (or a distilled drafter.path), else the default
    verifier (smollm2)."""
    source = cfg.verifier_path
    if not source and export is not None:
        source = export_verifier(read_config(export))
        if not source:
            raise UserError(f"checkpoint={str(export)!r} names no verifier; pass verifier_path=<the verifier>.")
    path = cfg.drafter.get("path") if not source and family_of(cfg.drafter) == "draft_model" else None
    if path:
        source = (read_draft_info(path) or {}).get("verifier")
    if OmegaConf.is_config(source):  # verifier_path={loader: tiny, seed: 1} on the command line
        source = OmegaConf.to_container(source, resolve=True)
    return source or "smollm2"


def build_drafter(cfg: DictConfig, drafter_cfg: DictConfig, verifier: Verifier, export: Path | None,
                  policy: Any = None) -> Drafter:
    """Instantiate one family's factory (conf/drafter/*.yaml) and call it with the verifier, the tree policy (`policy`,
    else conf/tree's) and the export; with `sampled_drafts`, the Medusa / EAGLE families also get the warped sampling
    settings for their proposals."""
    factory = instantiate(drafter_cfg, _convert_="all")
    proposals = {}
    if bool(cfg.get("sampled_drafts", False)):
        if family_of(drafter_cfg) not in NEEDS_EXPORT:
            raise UserError(f"sampled_drafts=true applies to the Medusa and EAGLE drafters (an export), not to "
                            f"drafter={family_of(drafter_cfg)}; drop sampled_drafts.")
        proposals = {"sampling": sampling_config(cfg),
                     "generator": torch.Generator(verifier.device).manual_seed(int(cfg.seed) + 1)}
    try:
        return factory(verifier, policy or instantiate(cfg.tree, _convert_="all"), export, **proposals)
    except VerifierMismatchError as e:  # its advice names train.py's key; here the verifier is `verifier_path`
        raise VerifierMismatchError(str(e).replace("verifier.path=", "verifier_path=")) from None


def family_of(drafter_cfg: DictConfig) -> str:
    """The family a drafter config builds: its factory's name (eval.families), the export's kind for `export`."""
    name = str(drafter_cfg._target_).rsplit(".", 1)[-1]
    return str(drafter_cfg.get("kind") or "export") if name == "export" else name


def export_dir(cfg: DictConfig, family: str) -> Path | None:
    """checkpoint=<export dir>, required by the export-based families, refused as a list outside method=all."""
    value = None if OmegaConf.is_missing(cfg, "checkpoint") else cfg.checkpoint
    if value is None:
        if family in NEEDS_EXPORT:
            raise UserError("checkpoint=<export dir> is required: the `export/` directory train.py printed, e.g. "
                            "python -m eval checkpoint=outputs/medusa-smollm2/export. Drafters that need no export: "
                            "drafter=draft_model, drafter=prompt_lookup, drafter=lookahead.")
        return None
    if OmegaConf.is_list(value):
        raise UserError(f"checkpoint={list(value)} is a list; one run takes one export (a list only with method=all).")
    return Path(str(value)).expanduser()


def setup(cfg: DictConfig) -> Setup:
    """Load prompts first (a bad prompt file fails in a second), then the verifier (the export's, `verifier_path`,
    else the default), then the drafter with its tree policy (it refuses an export made for another verifier, or a
    tree it cannot draft)."""
    family = family_of(cfg.drafter)
    export = export_dir(cfg, family)
    config = read_config(export) if export is not None else {}
    if export is not None and family == "export":
        if export_kind(config) is None:
            raise UserError(f"checkpoint={str(export)!r} is neither a Medusa nor an EAGLE export "
                            f"(architectures={config.get('architectures')}).")
        family = export_kind(config)
    convs = select_prompts(load_conversations(str(cfg.prompts), split="eval"), cfg.num_prompts)
    source = verifier_source_of(cfg, export)
    verifier = load_verifier(source, str(cfg.dtype), str(cfg.device), cfg.get("cache_dir"))
    policy = instantiate(cfg.tree, _convert_="all")
    def prefix() -> list[int]:  # a real prefix for the cost curve, checked before anything runs on it
        ids = prompt_ids(verifier.tokenizer, _turns(convs[0])[0])
        check_length(verifier, ids, int(cfg.max_new_tokens), f"prompt {convs[0].id!r}")
        return ids

    drafter, curves, planned, draft = cost.for_run(cfg, source, verifier, family, config, policy, prefix,
                                                   lambda p: build_drafter(cfg, cfg.drafter, verifier, export, p))
    if curves and family in EXPORT_KINDS:
        predicted = cost.predict(family, config, drafter, curves[0], draft)
    else:  # the hybrid under tree.size=auto: its primary's plan (what the grafted lookup adds is not in it)
        predicted = planned
    return Setup(verifier, drafter, method_name(family, drafter), convs, curves, predicted, planned is not None, draft)


def sampling_config(cfg: DictConfig) -> SamplingConfig:
    """temperature / top_p / top_k / typical from the config, checked (SamplingConfig raises one UserError each)."""
    values = {k: cfg.get(k, d) for k, d in (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0))}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{key}={value!r} must be a number.")
    return SamplingConfig(float(values["temperature"]), float(values["top_p"]), values["top_k"],
                          bool(cfg.get("typical", False)), float(cfg.get("posterior_threshold", 0.09)),
                          float(cfg.get("posterior_alpha", 0.3)))


def sampling_record(cfg: DictConfig) -> dict[str, Any]:
    """report.json's `sampling`: the settings and whether the speculative output keeps the verifier's distribution
    (`exact`); typical acceptance is marked lossy."""
    s = sampling_config(cfg)
    rule = "greedy" if s.greedy else "typical (lossy)" if s.typical else "rejection sampling (exact)"
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "rule": rule,
            "exact": s.greedy or not s.typical, "lossy": not s.greedy and s.typical,
            "sampled_drafts": bool(cfg.get("sampled_drafts", False)) and not s.greedy}


def run_peers(cfg: DictConfig, run: Setup, samples: list[Sample]) -> dict[str, Any]:
    """engine_peers=[vllm]: the run's prompts through the real vLLM, plain and with the export drafting."""
    export = None if cfg.checkpoint is None else Path(str(cfg.checkpoint)).expanduser()
    config = read_config(export) if export is not None else {}
    kind = export_kind(config) if export is not None else None
    prompts = [prompt_ids(run.verifier.tokenizer, _turns(c)[0]) for c in run.convs]
    tokens = cfg.get("engine_peer_tokens") or config.get("speculative_tokens")
    print(f"engine_peers: vLLM plain and {kind or 'no drafter'} on {len(prompts)} prompts")
    return {"vllm": vllm_peer(run.verifier, kind, export, prompts, [s.outputs["baseline"] for s in samples],
                              int(cfg.max_new_tokens), str(cfg.dtype), int(cfg.threads), float(cfg.temperature),
                              float(cfg.top_p), int(cfg.seed), tokens)}


def evaluate(cfg: DictConfig, progress: bool = True) -> dict[str, Any]:
    """Run `python -m eval` as configured by conf/eval.yaml; returns report.json's content."""
    if isinstance(cfg.threads, int) and int(cfg.threads) < 1:
        raise UserError(f"threads={cfg.threads} must be >= 1 (torch.set_num_threads).")
    for key in ("threads", "max_new_tokens", "seed", "prompt_lookup_num_tokens"):
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int):
            raise UserError(f"{key}={cfg[key]!r} must be a whole number.")
    if int(cfg.max_new_tokens) < 1:
        raise UserError(f"max_new_tokens={cfg.max_new_tokens} must be >= 1.")
    dtype_reason = "set in the config"
    if str(cfg.dtype) == "auto":
        dtype, dtype_reason = cost.auto_dtype(str(cfg.device))
        cfg.dtype = dtype
        print(f"dtype: {dtype} ({dtype_reason})")
    if str(cfg.dtype) not in EVAL_DTYPES:
        raise UserError(f"dtype={cfg.dtype!r} is not an evaluation dtype; use auto, float32 or bfloat16 (bf16 is "
                        f"exact through eval.engine, faster on CPUs with AMX or AVX512-BF16). float16 would also "
                        f"change the verifier's fingerprint, which is taken in bfloat16.")
    if str(cfg.get("engine", "auto")) not in ENGINES:
        raise UserError(f"engine={cfg.engine!r} is not one of {', '.join(ENGINES)} (auto: eval.engine where it is "
                        f"exact and faster, hf: Hugging Face's forward).")
    sampling = sampling_config(cfg)  # bad temperature / top_p / top_k fail before anything loads
    peers = check_peers(cfg.get("engine_peers") or [], bool(cfg.multi_turn), str(cfg.get("method", "single")))
    threads = torch.get_num_threads()
    torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(cfg.seed))
    if str(cfg.get("method", "single")) == "all":
        from eval.compare import compare

        try:
            return compare(cfg, progress)
        finally:
            torch.set_num_threads(threads)
    try:
        run = setup(cfg)
        engine = str(cfg.get("engine", "auto"))
        assistant, depth = assistant_of(run.drafter)
        runner = Runner(run.verifier, run.drafter, int(cfg.max_new_tokens), int(cfg.prompt_lookup_num_tokens),
                        sampling, int(cfg.seed), engine, assistant, depth)
        samples = run_prompts(runner, run.convs, bool(cfg.multi_turn), bool(cfg.warmup), progress)
        peer_report = run_peers(cfg, run, samples) if peers else None
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their own setting
    meta = {"method": run.method, "tree": run.drafter.describe(), "verifier": run.verifier.name,
            "checkpoint": None if cfg.checkpoint is None else str(cfg.checkpoint), "sampling": sampling_record(cfg)}
    setting = {"threads": int(cfg.threads), "dtype": str(cfg.dtype), "device": str(run.verifier.device),
               "dtype_reason": dtype_reason, "engine": "engine" if use_engine(run.verifier, engine) else "hf",
               "max_new_tokens": int(cfg.max_new_tokens), "prompt_source": str(cfg.prompts),
               "multi_turn": bool(cfg.multi_turn), "tree": run.drafter.describe()}
    if setting["engine"] == "engine":  # rows each weight's kernel is padded to, to stay batch-invariant here
        setting["engine_weight_rows"] = engine_of(run.verifier.model).weight_rows
    if run.predicted is not None:
        setting["cost_model"] = {**asdict(run.predicted), "tree_size_auto": run.auto_size,
                                 "draft_curve_ms": run.draft_curve,
                                 "note": "verify time from the cost curve plus the drafter's measured draft time "
                                         "(draft_curve_ms, at the curve's sizes); acceptance, commit and Python "
                                         "overhead excluded"}
    out_dir = Path(str(cfg.output_dir))
    if run.curves:
        cost.write(run.curves, out_dir, f"{run.verifier.name}: verifier forward cost")
    report = write_outputs(samples, meta, setting, run.drafter.max_depth, out_dir, cfg.wandb, peers=peer_report)
    if run.predicted is not None:
        p = run.predicted
        print(f"speedup: predicted {p.predicted_speedup:.2f}x from the cost curve ({p.size} drafts, E[tokens/round] "
              f"{p.expected_tokens:.2f}, verify {p.verify_ms:.1f} ms + draft {p.draft_ms:.1f} ms vs step {p.step_ms:.1f} ms)"
              f"{' [tree.size=auto]' if run.auto_size else ''}; measured {report['speedup']:.2f}x")
    return report
