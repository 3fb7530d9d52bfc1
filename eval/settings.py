"""`python -m eval`'s settings, parsed once: conf/eval.yaml (with the command line's overrides) read at `evaluate`'s
door into one frozen, typed `EvalSettings`, every value checked there (a bad one fails before anything loads; the
serving wing's settings too, nested as `serving`) and every default in one place, conf/eval.yaml (a key missing from
a hand-built config takes that file's value). The layers below take this object, or the few fields they need; none
reads the raw config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from eval.engine.acceptance import named_rule
from eval.engine.sampling import SamplingConfig, sampling_config
from eval.engine.tree import TreePolicy
from eval.serving import Serving
from eval.serving import settings as serving_settings
from runtime.errors import UserError

EVAL_DTYPES = ("float32", "bfloat16")
METHODS = ("single", "all")
PLANS = ("adaptive", "static")
CONF = Path(__file__).resolve().parents[1] / "conf" / "eval.yaml"  # every default of the run, held there only


def _help(text: str) -> Any:
    return field(metadata={"help": text})


@dataclass(frozen=True)
class WandbSettings:
    """conf/eval.yaml `wandb`: the W&B run's mode (null: $WANDB_MODE, else online with credentials, else offline),
    project and name."""

    mode: str | None
    project: str | None
    name: str | None


@dataclass(frozen=True)
class EvalSettings:
    """One run of `python -m eval`: each field is a key of conf/eval.yaml, checked (its help says what it holds)."""

    checkpoints: tuple[Path, ...] = _help("the export directories (checkpoint=; a list only with method=all)")
    checkpoint_list: bool = _help("checkpoint= was given as a list")
    checkpoint_label: str | None = _help("checkpoint= as given, for the report")
    method: str = _help("single: the configured drafter | all: every family available")
    alone: bool = _help("with a combination (the hybrid), also decode with each of its parts alone")
    drafter: DictConfig = _help("the drafter group's config (a Hydra partial: its factory and options)")
    tree: TreePolicy = _help("the tree policy of the export families, instantiated once (conf/tree)")
    plan: str | None = _help("how tree.size=auto's budget follows the run: null, adaptive or static")
    verifier_path: str | dict[str, object] | None = _help("the verifier to load (null: the export's, else smollm2)")
    dtype: str = _help("the verifier's dtype, resolved (auto -> float32 or bfloat16)")
    dtype_reason: str = _help("why that dtype (auto's reason, or `set in the config`)")
    drafter_dtype: str = _help("the dtype an export's drafter runs in, resolved")
    device: str = _help("cpu, cuda or auto")
    engine: str = _help("the verifier path of our decode loops: auto, engine or hf")
    cache_dir: str | None = _help("where verifiers are cached")
    prompts: str | tuple[str, ...] = _help("a prompt set, or several (reported per set)")
    num_prompts: int | None = _help("prompts per set (null: all; data.prompts.select_prompts checks it)")
    max_new_tokens: int = _help("tokens generated per prompt")
    multi_turn: bool = _help("every turn of a multi-turn set, measured apart")
    prompt_lookup_num_tokens: int = _help("the HF prompt-lookup reference's chain")
    sampling: SamplingConfig = _help("temperature, top_p, top_k and the acceptance rule's settings")
    sampled_drafts: bool = _help("drafters sample their proposals (export families, temperature > 0)")
    serving: Serving = _help("engine_peers, engine_peer_tokens, engine_concurrency, engine_prompt_lengths, checked "
                             "(eval.serving.settings): the peers, their K and the load sweep")
    warmup: bool = _help("one uncounted decode of the first prompt first")
    threads: int = _help("torch.set_num_threads for the run")
    seed: int = _help("the run's random seed")
    profile: bool = _help("the verifier's cost curves at other dtypes and thread counts")
    profile_dtypes: tuple[str, ...] = _help("profile=true's dtypes")
    profile_threads: tuple[int, ...] = _help("profile=true's thread counts")
    output_dir: Path = _help("where report.json, plots and outputs go")
    wandb: WandbSettings = _help("W&B: mode, project, name")

    @property
    def method_all(self) -> bool:
        return self.method == "all"

    @property
    def proposal_sampling(self) -> SamplingConfig | None:
        """The sampling settings the export families' proposals are drawn with (sampled_drafts), else None."""
        return self.sampling if self.sampled_drafts and not self.sampling.greedy else None


def _whole(cfg: DictConfig, key: str, least: int | None = None) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{key}={value!r} must be a whole number.")
    if least is not None and value < least:
        raise UserError(f"{key}={value} must be >= {least}" + (" (torch.set_num_threads)." if key == "threads"
                                                                else "."))
    return value


def flag(cfg: Any, key: str, default: bool) -> bool:
    """A true/false setting, strictly: Hydra reads `true` / `false` as booleans; a word (`no`, `yes`, `off`) stays
    a string, which bool() would take as true."""
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise UserError(f"{key}={value!r}: give true or false, e.g. {key}={str(default).lower()}.")
    return value


# The kinds a drafter factory's annotation names that the door checks (any other annotation is the factory's own).
_KINDS = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "a string"}


def _fits(value: Any, kinds: set[str]) -> bool:
    if value is None:
        return "None" in kinds
    if isinstance(value, bool):
        return "bool" in kinds
    return (isinstance(value, int) and bool(kinds & {"int", "float"}) or isinstance(value, float) and "float" in kinds
            or isinstance(value, str) and "str" in kinds)


def check_drafter(node: DictConfig, engine: str) -> None:
    """The drafter group's options (conf/drafter/<name>.yaml, drafter.<key>=... on the command line) against what its
    factory declares: a whole number where it takes an int, true or false where a bool, null only where it takes
    None; and drafter.budget within what a round verifies. Before anything loads: a word where a number goes ended
    in a TypeError once the drafter was built (drafter.num_tokens=abc), and drafter.sit_out=no turned it on."""
    import inspect

    from hydra.utils import get_object

    from eval.engine.session import TREE_ROOM

    try:
        params = inspect.signature(get_object(str(node._target_))).parameters
    except Exception:  # no target, or one that does not resolve: instantiate's own message
        return
    for key in node:
        param = params.get(str(key))
        if param is None or not isinstance(param.annotation, str):
            continue
        kinds = {part.strip() for part in param.annotation.split("|")}
        if not kinds <= {*_KINDS, "None"}:
            continue
        value = node[key]
        if _fits(value, kinds):
            continue
        what = " or ".join(_KINDS[k] for k in _KINDS if k in kinds and not (k == "int" and "float" in kinds))
        default = param.default
        fix = (", or null (the default)" if default is None else ", or null" if "None" in kinds else "") + (
            f", e.g. drafter.{key}={str(default).lower() if isinstance(default, bool) else default}"
            if default not in (None, inspect.Parameter.empty) else "")
        raise UserError(f"drafter.{key}={value!r}: give {what}{fix}.")
    budget = node.get("budget")
    if "budget" in params and isinstance(budget, int) and budget > TREE_ROOM and engine != "hf":
        raise UserError(f"drafter.budget={budget}: the budget is the nodes one round verifies (the root included), "
                        f"and a round verifies at most {TREE_ROOM}. Give drafter.budget in [2, {TREE_ROOM}], or null "
                        f"(the export drafter's own node count); engine=hf verifies more, not exact in bfloat16.")


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


@cache
def _defaults() -> DictConfig:
    """conf/eval.yaml's own keys (its defaults list and hydra section aside): the one place a default is written."""
    conf = OmegaConf.load(CONF)
    return OmegaConf.masked_copy(conf, [k for k in conf if k not in ("defaults", "hydra")])


def _complete(cfg: DictConfig) -> DictConfig:
    """`cfg` with conf/eval.yaml's value for every key it lacks (a hand-built config); a composed one has them all."""
    missing = [k for k in _defaults() if k not in cfg]
    if not missing:
        return cfg
    merged = OmegaConf.merge(OmegaConf.masked_copy(_defaults(), missing), cfg)
    assert isinstance(merged, DictConfig)
    return merged


def parse(cfg: DictConfig) -> EvalSettings:
    """The run's settings from its config, each checked, in the order a user would fix them."""
    from eval.drafters.build import resolve_drafter_dtype
    from eval.engine.session import ENGINES
    from eval.planner.cost import auto_dtype

    if "verifier" in cfg:  # `+verifier=<name>`: train.py's config group, which eval would ignore
        given = cfg.verifier.get("_target_", cfg.verifier) if OmegaConf.is_dict(cfg.verifier) else cfg.verifier
        raise UserError(f"+verifier= was given (it loads with {given}): python -m eval does not read the "
                        f"`verifier` group (train.py's); it decodes with the verifier the export names (its "
                        f"config.json `verifier`), or verifier_path= when given. Pass verifier_path=<smollm2, gemma3, "
                        f"a Hub id or a checkpoint directory> instead (an export made for another verifier is "
                        f"refused by its fingerprint).")
    cfg = _complete(cfg)
    threads = _whole(cfg, "threads", least=1)
    max_new_tokens, seed = _whole(cfg, "max_new_tokens"), _whole(cfg, "seed")
    lookup_tokens = _whole(cfg, "prompt_lookup_num_tokens")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} must be >= 1.")
    dtype, dtype_reason = str(cfg.dtype), "set in the config"
    if dtype == "auto":
        dtype, dtype_reason = auto_dtype(str(cfg.device))
        print(f"dtype: {dtype} ({dtype_reason})")
    if dtype not in EVAL_DTYPES:
        raise UserError(f"dtype={cfg.dtype!r} is not an evaluation dtype; use auto, float32 or bfloat16 (bf16 is "
                        f"exact through eval.engine.forward, faster on CPUs with AMX or AVX512-BF16). float16 would "
                        f"also change the verifier's fingerprint, which is taken in bfloat16.")
    engine = str(cfg.engine)
    if engine not in ENGINES:
        raise UserError(f"engine={engine!r} is not one of {', '.join(ENGINES)} (auto: eval.engine.forward where it "
                        f"is exact and faster, hf: Hugging Face's forward).")
    method = str(cfg.method)
    if method not in METHODS:
        raise UserError(f"method={method!r} is not one of {', '.join(METHODS)} (single: the configured drafter, all: "
                        f"every family available).")
    sampling = sampling_config(cfg)  # bad temperature / top_p / top_k / verify fail before anything loads
    named_rule(sampling)  # verify= names a registered rule (eval.engine.acceptance)
    check_drafter(cfg.drafter, engine)
    flags = {key: flag(cfg, key, _defaults()[key])
             for key in ("alone", "multi_turn", "sampled_drafts", "warmup", "profile")}
    drafter_dtype = resolve_drafter_dtype(cfg.drafter_dtype, dtype)
    value = None if OmegaConf.is_missing(cfg, "checkpoint") else cfg.checkpoint
    is_list = OmegaConf.is_list(value) or isinstance(value, list | tuple)
    checkpoints = tuple(Path(str(p)).expanduser() for p in (value if is_list else [value] if value else []))
    if is_list and method != "all" and checkpoints:
        raise UserError(f"checkpoint={[str(c) for c in checkpoints]} is a list; one run takes one export (a list "
                        f"only with method=all).")
    plan = cfg.plan
    if plan is not None and str(plan) not in PLANS:  # what plan= means for this run: eval.setup.check (plan_mode)
        raise UserError(f"plan={plan!r} is not a plan; use plan=adaptive (re-plan the tree.size=auto budget from the "
                        f"acceptance measured while decoding), plan=static (the budget planned once, from the "
                        f"export's table) or leave it out (adaptive under tree.size=auto).")
    prompts = cfg.prompts
    prompts = str(prompts) if isinstance(prompts, str) else tuple(str(p) for p in prompts)
    multi_turn, label = flags["multi_turn"], None if value is None else str(value)
    serving = serving_settings([str(p) for p in (cfg.engine_peers or [])], _plain(cfg.engine_peer_tokens),
                               _plain(cfg.engine_concurrency), _plain(cfg.engine_prompt_lengths), multi_turn, method,
                               label)
    wandb = _plain(cfg.wandb) or {}
    return EvalSettings(
        checkpoints=checkpoints, checkpoint_list=is_list, checkpoint_label=label,
        method=method, alone=flags["alone"], drafter=cfg.drafter,
        tree=instantiate(cfg.tree, _convert_="all"), plan=None if plan is None else str(plan),
        verifier_path=_plain(cfg.verifier_path), dtype=dtype, dtype_reason=dtype_reason,
        drafter_dtype=drafter_dtype, device=str(cfg.device), engine=engine,
        cache_dir=cfg.cache_dir, prompts=prompts, num_prompts=cfg.num_prompts,
        max_new_tokens=max_new_tokens, multi_turn=multi_turn,
        prompt_lookup_num_tokens=lookup_tokens, sampling=sampling,
        sampled_drafts=flags["sampled_drafts"], serving=serving, warmup=flags["warmup"],
        threads=threads, seed=seed, profile=flags["profile"],
        profile_dtypes=tuple(str(d) for d in (cfg.profile_dtypes or [dtype])),
        profile_threads=tuple(int(t) for t in (cfg.profile_threads or [threads])),
        output_dir=Path(str(cfg.output_dir)),
        wandb=WandbSettings(wandb.get("mode"), wandb.get("project", _defaults().wandb.project), wandb.get("name")))
