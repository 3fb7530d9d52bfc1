"""The EAGLE-family draft forward at decode time (models/eagle_decode.py, eval/drafters/eagle.py) against the code it
replaced, kept here as the reference: the same draft tokens, the same draft distributions, the same cached keys and
the same outputs of every drafter forward, bit for bit (torch.equal), round after round of real speculative decoding,
with `trial` calls between rounds; on random EAGLE-1 / EAGLE-3 / EAGLE-3.1 / P-EAGLE drafters over a tiny verifier
(fp32 and bf16 verifiers, fp32 and bf16 drafter weights) and on the shipped EAGLE-3 export over the default verifier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from eval.drafters.eagle import EagleDrafter, _Fed
from eval.drafters.peagle import PEagleDrafter
from eval.engine.decode import speculative_decode
from eval.engine.sampling import SamplingConfig
from eval.engine.tree import Chain, DynamicTree, Tree
from helpers import ROOT
from models.eagle import build_eagle
from models.peagle import build_peagle
from models.verifiers.tiny import build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["Hello, my name is", "def fib(n):\n    return"]


# -- the reference: the drafter forward as it was before models/eagle_decode.py (net.step, keys concatenated) ------

class _OldExtend:
    def _extend(self, input_ids, hidden):
        bsz, s = hidden.shape[:2]
        start, n, layers = self._new_positions(input_ids, hidden)
        feats = self.net.features(layers)
        emb = self.embed(input_ids[:, start + 1 : n + 1])
        pos = torch.arange(start, n, device=input_ids.device)
        mask = (torch.arange(n, device=pos.device)[None, :] <= pos[:, None])[None, None].expand(bsz, 1, s, n)
        out, k, v = self.net.step(feats, emb, pos[None].expand(bsz, s), mask, self._k, self._v)
        self._k = k if self._k is None else torch.cat([self._k, k], dim=2)
        self._v = v if self._v is None else torch.cat([self._v, v], dim=2)
        self.outs.append(out[:, -1])
        return out[:, -1]


class _OldFed:
    def __init__(self, drafter, root_out):
        self.drafter, dev = drafter, root_out.device
        self.out_of, self.slot_of = {-1: drafter.net.carry(root_out)[0]}, {}
        self.k = self.v = None
        self.anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)

    def feed(self, nodes, ids, parents, depth):
        d = self.drafter
        m, f = len(nodes), 0 if self.k is None else self.k.shape[2]
        mine = torch.zeros(m, f + m, dtype=torch.bool, device=ids.device)
        for j, (c, parent) in enumerate(zip(nodes, parents)):
            if parent >= 0:
                mine[j, :f] = self.anc[self.slot_of[parent]]
            mine[j, f + j] = True
            self.slot_of[c] = f + j
        self.anc = torch.cat([torch.cat([self.anc, self.anc.new_zeros(f, m)], dim=1), mine], dim=0)
        mask = torch.cat([mine.new_ones(m, d.cache_length), mine], dim=1)[None, None]
        past_k = d._k if self.k is None else torch.cat([d._k, self.k], dim=2)
        past_v = d._v if self.v is None else torch.cat([d._v, self.v], dim=2)
        pos = torch.full((1, m), d.cache_length - 1 + depth, device=ids.device)
        hid = torch.stack([self.out_of[parent] for parent in parents])[None]
        out, k, v = d.net.step(hid, d.embed(ids[None]), pos, mask, past_k, past_v)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        carried = d.net.carry(out)
        for j, c in enumerate(nodes):
            self.out_of[c] = carried[0, j]
        d.outs.append(out[0])
        return out[0]


class _NewRecorded:
    def _extend(self, input_ids, hidden):
        out = super()._extend(input_ids, hidden)
        self.outs.append(out)
        return out


class _NewFed(_Fed):
    def feed(self, nodes, ids, parents, depth):
        out = super().feed(nodes, ids, parents, depth)
        self.drafter.outs.append(out)
        return out


def _classes(base: type) -> tuple[type, type]:
    """(the new drafter, recording its forwards' outputs; the reference one) over drafter class `base`."""
    new = type("New" + base.__name__, (_NewRecorded, base), {"fed_class": _NewFed})
    ref = type("Ref" + base.__name__, (_OldExtend, base), {"fed_class": _OldFed})
    return new, ref


def _pair(base: type, *args: Any, seed: int = 0, **kw: Any) -> tuple[EagleDrafter, EagleDrafter]:
    out = []
    for cls in _classes(base):
        gen = torch.Generator().manual_seed(seed) if kw.get("sampling") else None
        d = cls(*args, generator=gen, **kw)
        d.outs = []
        out.append(d)
    return out[0], out[1]


def _same(a: Any, b: Any, what: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b), what
    else:
        assert a == b, what


class _Lockstep:
    """A drafter for speculative_decode that runs the new drafter and the reference on the same inputs and checks
    every round: a `trial` of a few sizes first (it must leave the cache as it was), then `propose`."""

    def __init__(self, new: EagleDrafter, ref: EagleDrafter) -> None:
        self.new, self.ref, self.rounds = new, ref, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.new, name)

    def propose(self, input_ids, hidden):
        for drafts in (0, 1, 3, 7) if self.rounds % 3 == 1 and self.new.sampling is None else ():
            _same(self.new.trial(input_ids, hidden, drafts), self.ref.trial(input_ids, hidden, drafts), "trial")
        a, b = self.new.propose(input_ids, hidden), self.ref.propose(input_ids, hidden)
        _same(a.tree, b.tree, "tree")
        _same(a.tokens, b.tokens, "draft tokens")
        if a.p is not None or b.p is not None:
            _same(a.p, b.p, "draft distributions")
        _same(self.new._k, self.ref._k, "cached keys")
        _same(self.new._v, self.ref._v, "cached values")
        assert len(self.new.outs) == len(self.ref.outs) > 0
        for x, y in zip(self.new.outs, self.ref.outs):
            _same(x, y, "a drafter forward's output")
        self.new.outs.clear()
        self.ref.outs.clear()
        self.rounds += 1
        return a

    def accepted(self, num_accepted, nodes):
        self.new.accepted(num_accepted, nodes)
        self.ref.accepted(num_accepted, nodes)


def _lockstep(verifier, new, ref, prompts=PROMPTS, max_new=24, sampling=None) -> int:
    rounds = 0
    for prompt in prompts:
        ids = torch.tensor([verifier.tokenizer(prompt)["input_ids"]])
        step = _Lockstep(new, ref)
        gen = torch.Generator().manual_seed(1) if sampling else None
        speculative_decode(verifier, step, ids, max_new, [], sampling=sampling, generator=gen)
        rounds += step.rounds
    return rounds


def _random(kind: str, verifier, seed: int = 0, dtype: torch.dtype = torch.float32):
    v31 = kind == "eagle3.1"
    if kind == "peagle":
        net = build_peagle(verifier, 16, 4, draft_vocab_size=512, aux_layer_ids=[0, 1])
    else:
        base = "eagle3" if v31 else kind
        net = build_eagle(base, verifier, draft_vocab_size=512 if base == "eagle3" else None,
                          aux_layer_ids=[0, 1] if base == "eagle3" else None, fc_norm=v31, norm_output=v31)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif v31:
                p.copy_(torch.rand(p.shape, generator=gen) * 2)
        if kind != "eagle":
            net.set_draft_vocab(torch.randperm(verifier.vocab_size, generator=gen)[:512])
    return net.to(dtype)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def verifier(request, cache_dir):
    return build_tiny(cache_dir=cache_dir, dtype=request.param, device="cpu", seed=1, layer_std=0.3)


DYNAMIC = DynamicTree(size=12, depth=4, topk=4)


# Each family, each tree kind and each weight dtype at least once (not every product of them: CI time).
@pytest.mark.parametrize("kind, tree, net_dtype", [
    ("eagle3", DYNAMIC, torch.float32), ("eagle3", DYNAMIC, torch.bfloat16), ("eagle3", Chain(3), torch.float32),
    ("eagle", DYNAMIC, torch.float32), ("eagle3.1", DYNAMIC, torch.bfloat16)],
    ids=["eagle3-dynamic-fp32-net", "eagle3-dynamic-bf16-net", "eagle3-chain-fp32-net", "eagle-dynamic-fp32-net",
         "eagle3.1-dynamic-bf16-net"])
def test_eagle_drafts_as_before_bit_for_bit(verifier, kind, tree, net_dtype):
    net = _random(kind, verifier, dtype=net_dtype)
    new, ref = _pair(EagleDrafter, net, verifier, tree)
    assert _lockstep(verifier, new, ref) > 4


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_sampled_eagle_drafts_as_before_bit_for_bit(verifier, kind):
    net = _random(kind, verifier)
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    new, ref = _pair(EagleDrafter, net, verifier, DynamicTree(size=8, depth=3, topk=3), sampling=sampling)
    assert _lockstep(verifier, new, ref, sampling=sampling) > 4


def test_peagle_drafts_as_before_bit_for_bit(verifier):
    net = _random("peagle", verifier)
    tree = Tree(parents=(-1, 0, 0, 1, 3), ranks=(-1, 0, 1, 0, 0))
    new, ref = _pair(PEagleDrafter, net, verifier, tree)
    assert _lockstep(verifier, new, ref) > 4


def test_the_lockstep_check_sees_a_one_bit_change(verifier):
    """The negative control: the new path with its rotary table off by one ulp at one position fails the check."""
    net = _random("eagle3", verifier)
    new, ref = _pair(EagleDrafter, net, verifier, DynamicTree(size=12, depth=4, topk=4))
    new.fast.rotary(torch.tensor([255]))  # build the table
    with torch.inference_mode():
        new.fast._cos[3:] = torch.nextafter(new.fast._cos[3:], torch.tensor(2.0))
    with pytest.raises(AssertionError):
        _lockstep(verifier, new, ref)


SHIPPED = ROOT / "pretrained" / "eagle3-smollm2"


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="no shipped EAGLE-3 export")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_shipped_eagle3_drafts_as_before_bit_for_bit(dtype, cache_dir):
    from models.exports.io import load_export
    from models.verifiers.embedded import load_smollm2

    verifier = load_smollm2(cache_dir=cache_dir, dtype=dtype, device="cpu")
    export = load_export(Path(SHIPPED), verifier)
    new, ref = _pair(EagleDrafter, export.net.to(verifier.device), verifier, DynamicTree(size=10, depth=4, topk=8))
    assert _lockstep(verifier, new, ref, prompts=["Write a Python function that reverses a list."],
                     max_new=32) > 4


def test_a_replaced_step_is_what_runs(verifier):
    """Where the net's step was replaced on the instance (a wrapper, a test's probe), the drafter runs it: the same
    bits, through it."""
    net = _random("eagle3", verifier)
    calls: list[int] = []
    step = net.step
    net.step = lambda *a, **k: calls.append(a[0].shape[1]) or step(*a, **k)
    new, ref = _pair(EagleDrafter, net, verifier, DynamicTree(size=12, depth=4, topk=4))
    assert _lockstep(verifier, new, ref, prompts=PROMPTS[:1]) > 2
    assert calls


def test_two_threads_draft_as_before_bit_for_bit(verifier):
    """Kernels split their work by thread count: the fused and packed products are decided per count (the probes are
    keyed by it), so a drafter built on one thread and run on two drafts as the reference does on two."""
    net = _random("eagle3", verifier)
    new, ref = _pair(EagleDrafter, net, verifier, DynamicTree(size=12, depth=4, topk=4))
    assert _lockstep(verifier, new, ref, prompts=PROMPTS[:1]) > 2
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _lockstep(verifier, new, ref, prompts=PROMPTS[1:]) > 2
    finally:
        torch.set_num_threads(before)  # the worker's share of the cores (conftest) for the tests after this one
