"""The evaluation harness behind `python -m eval`: load an export and its verifier, then decode every prompt with
four methods, interleaved in one process so that they share the machine's state:

- `baseline`: our plain greedy decoding, one verifier forward per token, through the same cache code;
- `speculative`: greedy speculative decoding with the exported drafter over the configured chain or tree;
- `hf_generate`: Hugging Face `model.generate`, greedy, as an outside reference;
- `hf_prompt_lookup`: the same with `prompt_lookup_num_tokens`, HF's own drafter-free speculation.

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
from eval.decode import ENGINES, DecodeResult, greedy_decode, speculative_decode, use_engine
from hydra.utils import instantiate

from eval import cost
from eval.drafters import Drafter, make_drafter
from eval.report import Sample, write_outputs
from models.errors import UserError, VerifierMismatchError
from models.export import export_kind, export_verifier, read_config
from models.verifier import Verifier, load_verifier

EVAL_DTYPES = ("float32", "bfloat16")


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


class Runner:
    """Decodes one prompt with every method and times each (wall clock around the whole call, so that our loops and
    HF's are measured the same way)."""

    def __init__(self, verifier: Verifier, drafter: Drafter, max_new_tokens: int, lookup: int,
                 engine: str = "auto") -> None:
        self.verifier, self.drafter, self.max_new, self.engine = verifier, drafter, max_new_tokens, engine
        gen_eos = verifier.model.generation_config.eos_token_id
        eos = {verifier.tokenizer.eos_token_id} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos = sorted(e for e in eos if e is not None)
        # Every field that could change greedy output is set here, so the checkpoint's generation_config.json
        # (which fills unset fields) cannot leak a repetition penalty or a sampling default into the reference.
        common = dict(
            max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0,
            min_new_tokens=0, eos_token_id=self.eos, pad_token_id=verifier.tokenizer.pad_token_id, use_cache=True,
        )
        self.hf_config = GenerationConfig(**common)
        self.lookup_config = GenerationConfig(**common, prompt_lookup_num_tokens=lookup)

    def _sync(self) -> None:
        if self.verifier.device.type == "cuda":
            torch.cuda.synchronize()

    def _hf(self, ids: Tensor, config: GenerationConfig) -> list[int]:
        out = self.verifier.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out[0, ids.shape[1]:].tolist()

    def decode(self, ids: list[int], prompt_id: str = "", category: str = "", turn: int = 0) -> Sample:
        """Every method on one prompt, in a fixed interleaved order."""
        x = torch.tensor([ids], device=self.verifier.device)  # (1, T)
        seconds, outputs, results = {}, {}, {}
        v, n = self.verifier, self.max_new
        calls = {
            "baseline": lambda: greedy_decode(v, x, n, self.eos, engine=self.engine),
            "speculative": lambda: speculative_decode(v, self.drafter, x, n, self.eos, engine=self.engine),
            "hf_generate": lambda: self._hf(x, self.hf_config),
            "hf_prompt_lookup": lambda: self._hf(x, self.lookup_config),
        }
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


def setup(cfg: DictConfig) -> Setup:
    """Load prompts first (a bad prompt file fails in a second), then the verifier the export names, then the
    drafter with its tree policy (it refuses an export made for another verifier, or a tree it cannot draft)."""
    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise UserError("checkpoint=<export dir> is required: the `export/` directory train.py printed, e.g. "
                        "python -m eval checkpoint=outputs/medusa-smollm2/export.")
    convs = select_prompts(load_conversations(str(cfg.prompts), split="eval"), cfg.num_prompts)
    export = Path(str(cfg.checkpoint)).expanduser()
    config = read_config(export)
    source = cfg.verifier_path or export_verifier(config)
    if OmegaConf.is_config(source):  # verifier_path={loader: tiny, seed: 1} on the command line
        source = OmegaConf.to_container(source, resolve=True)
    if not source:
        raise UserError(f"checkpoint={str(export)!r} names no verifier; pass verifier_path=<the verifier>.")
    kind = export_kind(config)
    if kind is None:
        raise UserError(f"checkpoint={str(export)!r} is neither a Medusa nor an EAGLE export "
                        f"(architectures={config.get('architectures')}).")
    verifier = load_verifier(source, str(cfg.dtype), str(cfg.device), cfg.get("cache_dir"))
    policy = instantiate(cfg.tree, _convert_="all")
    prefix = lambda: prompt_ids(verifier.tokenizer, _turns(convs[0])[0])  # noqa: E731  a real prefix for the curve
    policy, curves, planned = cost.for_run(cfg, source, verifier, kind, config, policy, prefix)
    try:
        drafter = make_drafter(kind, verifier, policy, checkpoint=export)
    except VerifierMismatchError as e:  # its advice names train.py's key; here the verifier is `verifier_path`
        raise VerifierMismatchError(str(e).replace("verifier.path=", "verifier_path=")) from None
    method = f"{kind}/{drafter.describe()['policy']}-{drafter.max_nodes - 1}"
    predicted = cost.predict(kind, config, drafter, curves[0]) if curves else None
    return Setup(verifier, drafter, method, convs, curves, predicted, planned is not None)


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
    threads = torch.get_num_threads()
    torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(cfg.seed))
    try:
        run = setup(cfg)
        engine = str(cfg.get("engine", "auto"))
        runner = Runner(run.verifier, run.drafter, int(cfg.max_new_tokens), int(cfg.prompt_lookup_num_tokens), engine)
        samples = run_prompts(runner, run.convs, bool(cfg.multi_turn), bool(cfg.warmup), progress)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their own setting
    meta = {"method": run.method, "verifier": run.verifier.name, "checkpoint": str(cfg.checkpoint)}
    setting = {"threads": int(cfg.threads), "dtype": str(cfg.dtype), "device": str(run.verifier.device),
               "dtype_reason": dtype_reason, "engine": "engine" if use_engine(run.verifier, engine) else "hf",
               "max_new_tokens": int(cfg.max_new_tokens), "prompt_source": str(cfg.prompts),
               "multi_turn": bool(cfg.multi_turn), "tree": run.drafter.describe()}
    if run.predicted is not None:
        setting["cost_model"] = {**asdict(run.predicted), "tree_size_auto": run.auto_size,
                                 "note": "verify time from the cost curve, draft time excluded"}
    out_dir = Path(str(cfg.output_dir))
    if run.curves:
        cost.write(run.curves, out_dir, f"{run.verifier.name}: verifier forward cost")
    report = write_outputs(samples, meta, setting, run.drafter.max_depth, out_dir, cfg.wandb)
    if run.predicted is not None:
        p = run.predicted
        print(f"speedup: predicted {p.predicted_speedup:.2f}x from the cost curve ({p.size} drafts, E[tokens/round] "
              f"{p.expected_tokens:.2f}, verify {p.verify_ms:.1f} ms vs step {p.step_ms:.1f} ms, draft time excluded)"
              f"{' [tree.size=auto]' if run.auto_size else ''}; measured {report['speedup']:.2f}x")
    return report
