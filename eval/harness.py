"""The evaluation harness behind `python -m eval`: five calls over one run.

    s = settings.parse(cfg)           # every key typed and checked, the serving wing's included, before anything loads
    run = setup.open(s)               # exports, prompts and verifier read once; every refusal; the verifier path
    planning.build(run)               # the drafters (tree.size=auto: planned on the verifier's cost curve)
    samples = run_prompts(...)        # eval.runner decodes every prompt with every method, interleaved
    published.write(run, samples, serving.measure(...))   # the serving wing, then report.json, plots, W&B

Methods, interleaved in one process so that they share the machine's state:

- `baseline`: our plain greedy decoding (plain sampling when temperature > 0), one verifier forward per token,
  through the same cache code;
- `speculative` (or, with method=all, one label per family): speculative decoding with the drafter over its chain
  or tree, greedy or sampled (eval.engine.sampling: exact rejection sampling, or Medusa's lossy typical acceptance when
  typical=true); beside a combination (the hybrid), `drafter_alone` and `grafted_alone`, its parts by themselves;
- `hf_generate`: Hugging Face `model.generate`, greedy or sampled alike, as an outside reference;
- `hf_prompt_lookup`: the same with `prompt_lookup_num_tokens`, HF's own drafter-free speculation;
- `hf_assisted` (with a draft model): HF assisted generation with the same draft model as `assistant_model` and a
  constant `num_assistant_tokens` = its depth.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from eval import planning, published, serving, setup
from eval.engine.exports import once_per_run
from eval.runner import run_prompts
from eval.settings import EvalSettings, parse


def evaluate(cfg: DictConfig, progress: bool = True) -> dict[str, Any]:
    """Run `python -m eval` as configured by conf/eval.yaml; returns report.json's content. The config is read here
    only, parsed once into the run's settings (eval.settings: every value checked before anything loads)."""
    return evaluate_settings(parse(cfg), progress)


def evaluate_settings(s: EvalSettings, progress: bool = True) -> dict[str, Any]:
    """The run for settings already parsed (eval.settings.parse)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    try:
        with once_per_run():  # each export's weights read once, shared by the drafters built from it
            run = setup.open(s)
            planning.build(run)
            wing = serving.ready(run)  # the sweep's length groups and clients, before decoding
            runner = planning.runner(run)  # the acceptance rule checked against the drafters, before decoding
            samples = run_prompts(runner, run.convs, s.multi_turn, s.warmup, progress)
            peers = serving.measure(wing, s, run, samples)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their own setting
    return published.write(run, samples, peers)
