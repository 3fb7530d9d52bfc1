"""Batched generation with refill (continuous batching) over a Hugging Face causal LM, for data building.

`model.generate` on a batch runs until its longest answer ends: rows that stopped at EOS keep being computed, and
the batch shrinks in useful work as it goes. Here a row that stops leaves the batch at once and a queued prompt
takes its place, so the batch stays full:

1. Take the next prompts from the queue (sorted by length, so a refill group needs little padding) and prefill them
   as one left-padded forward with their own KV cache.
2. Merge that cache into the running one: both are left-padded to the longer key length and concatenated on the
   batch axis; the 2-D attention mask marks the padding, and each row keeps its own position ids.
3. Decode one token for every row in one forward; sample (greedy, or temperature + top-p).
4. Rows that produced a stop token or reached `max_new_tokens` leave: their cache rows are dropped, and key
   columns that are padding in every remaining row are cut from the left.
5. When at least `refill_at` slots are free (or the batch is empty), go to 1.

Randomness: each prompt draws from its own `torch.Generator`, seeded by (`seed`, the prompt's key: its index, or
`keys`), so a prompt's sampled answer does not depend on the batch size, its neighbours or where a run restarted
(up to the batched matmuls' rounding, which can differ with the row count in bf16).

Attention: on a CPU, PyTorch's SDPA kernel is slow for one-token queries (measured, SmolLM2's 9 query / 3 KV heads,
batch 48, 200 keys, bf16, 1 thread: 2.2 ms a layer with a padding mask and 13 ms without one, where HF takes its
`enable_gqa` path; the same attention as two grouped matmuls takes 0.7 ms). A whole decode step spent 67% of its time
there. `decode_attention` computes one-token queries as grouped matmuls (each KV head's query group is one matrix)
and leaves every longer forward to SDPA; `generate_refill` switches the model to it for its duration. Data building
only: the decode loops of eval/ keep their own attention, whose numerics the exactness tests pin.

Linears: in bf16 on a CPU, F.linear reorders each weight into oneDNN's layout on every call; `generate_refill` runs
them through prepacked copies instead (`models.packed.packed_linears`, made once per call, freed after).

KV cache: a `DynamicCache` grows by concatenation, so every decode step copied the whole batch's cache (measured,
48 rows x 256 new tokens, bf16, one thread: `cat` 29% of the run, more than attention). For Llama-family models
(decoder layers called as HF calls them: embed_tokens, rotary_emb, layers, norm) the decode steps run on `_Slots`
instead: one preallocated buffer per layer, row r's keys at columns [0, length_r), each step writing one column per
row in place (attending over a contiguous block: see `_Slots`); a finished row's slot is refilled by moving the last
row into it, so the running rows stay contiguous and a step computes only them. The prefill of a group stays HF's
forward (SDPA), its cache copied into the slots.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from models.packed import packed_linears
from models.verifiers.core import Verifier


def row_generator(seed: int, key: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The random stream of one prompt: a function of (seed, key) only, so what a row samples never depends on
    which rows share its batch, the batch size, or where a resumed build restarts."""
    return torch.Generator(device=device).manual_seed((seed * 0x9E3779B97F4A7C15 + key) % 2**63)


def sample(logits: Tensor, temperature: float, top_p: float, gens: Sequence[torch.Generator] | None) -> Tensor:
    """Next tokens (B,) from logits (B, V): argmax at temperature 0, else nucleus sampling (Holtzman et al. 2020),
    row b drawing one uniform from `gens[b]` and inverting the kept tokens' cumulative distribution."""
    if temperature <= 0:
        return logits.float().argmax(-1)  # bf16 argmax over a 49k vocabulary: 8.6 ms (48 rows), float: 3.0 ms
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    idx = None
    if top_p < 1.0:
        probs, idx = probs.sort(dim=-1, descending=True)
        probs[(probs.cumsum(-1) - probs) > top_p] = 0.0  # keep the smallest prefix reaching top_p
    cdf = probs.cumsum(-1)
    u = torch.cat([torch.rand(1, generator=g, device=g.device) for g in gens]).to(cdf.device)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)
    return (choice if idx is None else idx.gather(-1, choice))[:, 0]


DECODE_ATTENTION = "specdraft_decode"


def decode_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[Tensor, None]:
    """HF attention-interface function: one-token queries as grouped matmuls, anything else through SDPA.

    query (B, H, 1, D), key/value (B, KVH, T, D) with H = G * KVH; attention_mask: None, bool (B, 1, 1, T) (True =
    attend) or additive float. Returns (B, 1, H, D), as HF's attention functions do."""
    bsz, heads, q_len, dim = query.shape
    if q_len != 1 or dropout > 0 or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads, keys = key.shape[1], key.shape[2]
    q = query * (scaling if scaling is not None else dim**-0.5)
    q = q.reshape(bsz, kv_heads, heads // kv_heads, dim)  # (B, KVH, G, D): head h uses KV head h // G
    # Scores stay in the model dtype (the matmul rounds them to it anyway) and softmax reads them as they are, with
    # float accumulation inside: a float copy of the scores, its masking and its cast back cost more than both
    # matmuls at 96 rows x 320 keys (measured: 3.7 -> 2.6 ms a layer, bf16, one thread).
    scores = torch.matmul(q, key.transpose(-1, -2))  # (B, KVH, G, T)
    if attention_mask is not None:  # (B, 1, 1, >=T)
        mask = attention_mask[:, :, -1:, :keys]
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores = scores + mask.to(scores.dtype)
    out = torch.matmul(scores.softmax(-1), value)  # (B, KVH, G, D)
    return out.reshape(bsz, heads, 1, dim).transpose(1, 2), None


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


class decode_attention_for:
    """Context manager: `model` runs `decode_attention` inside, its own attention implementation again after."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.before = getattr(model.config, "_attn_implementation", None)

    def __enter__(self) -> None:
        if self.before in ("sdpa", "eager"):
            self.model.set_attn_implementation(DECODE_ATTENTION)

    def __exit__(self, *exc: object) -> None:
        if self.before in ("sdpa", "eager"):
            self.model.set_attn_implementation(self.before)


def _left_pad(t: Tensor, width: int) -> Tensor:
    """Pad (B, H, T, D) keys/values on the left of the T axis to `width`."""
    if t.shape[-2] == width:
        return t
    pad = t.new_zeros((*t.shape[:-2], width - t.shape[-2], t.shape[-1]))
    return torch.cat([pad, t], dim=-2)


MIN_SHARED_PREFIX = 8  # a shorter common prefix is recomputed per prompt (its own forward costs more than it saves)


def _common_prefix(prompts: Sequence[list[int]]) -> int:
    """Length of the prompts' longest common prefix, leaving every prompt at least one token of its own (the
    prefill's last position gives a row its first answer token); 0 below MIN_SHARED_PREFIX or for one prompt."""
    if len(prompts) < 2:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        n = min(n, next((j for j in range(n) if p[j] != first[j]), n))
    return n if n >= MIN_SHARED_PREFIX else 0


class _Batch:
    """The running rows on HF's DynamicCache (any model): KV cache, 2-D attention mask, next position, last token.
    Same interface as `_Slots`: `n`, `rows`, `last`, `add`, `step`, `remove`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)  # (B, T)
        self.rows: list[int] = []  # prompt index of each row
        self.pos: list[int] = []
        self.last: list[int] = []

    @property
    def n(self) -> int:
        return len(self.rows)

    def add(self, cache: DynamicCache, mask: Tensor, rows: list[int], last: list[int]) -> None:
        """Merge a prefilled group: both caches left-padded to the longer key length, concatenated on the batch."""
        pos = mask.sum(1).tolist()  # a row's next position: its real columns
        if self.cache is None or not self.rows:
            self.cache, self.mask, self.rows, self.pos, self.last = cache, mask, rows, pos, last
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        pad = lambda m: torch.cat([m.new_zeros((m.shape[0], width - m.shape[1])), m], dim=1)  # noqa: E731
        self.mask = torch.cat([pad(self.mask), pad(mask)])
        self.rows, self.pos, self.last = self.rows + rows, self.pos + pos, self.last + last

    def step(self) -> Tensor:
        """One decode step for every row; returns the next-token logits (n, V)."""
        device = self.cache.layers[0].keys.device
        self.mask = torch.cat([self.mask, torch.ones((self.n, 1), dtype=torch.long)], dim=1)
        out = self.model(input_ids=torch.tensor(self.last, device=device)[:, None],
                         attention_mask=self.mask.to(device),
                         position_ids=torch.tensor(self.pos, device=device)[:, None], cache=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.pos = [p + 1 for p in self.pos]
        return out.logits[:, -1]

    def remove(self, finished: list[int]) -> None:
        """Drop rows `finished` (indices into the batch), then cut key columns that no remaining row uses."""
        if not finished:
            return
        keep = [r for r in range(self.n) if r not in set(finished)]
        if not keep:
            self.cache, self.mask, self.rows, self.pos, self.last = None, self.mask[:0], [], [], []
            return
        idx = torch.tensor(keep, device=self.cache.layers[0].keys.device)
        self.mask = self.mask[keep]
        used = self.mask.any(0).nonzero()
        start = int(used[0]) if len(used) else 0
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[..., start:, :]
            layer.values = layer.values.index_select(0, idx)[..., start:, :]
        self.mask = self.mask[:, start:]
        self.rows = [self.rows[i] for i in keep]
        self.pos = [self.pos[i] for i in keep]
        self.last = [self.last[i] for i in keep]


SLOT_BLOCK = 64  # the slot cache's key length is a multiple of this


class _Slots:
    """Preallocated KV cache for the running rows. keys/values (layers, B, KVH, C, D); row r holds its `length[r]`
    keys at columns [0, length[r]) in position order (prompt positions 0.., no padding); rows [0, n) are running.

    C is the longest row's length rounded up to `SLOT_BLOCK`, and a step attends over all C columns (masked): a
    step's keys are then one contiguous (n, KVH, C, D) block. A slice [:, :, :span] of a longer buffer is strided
    between rows, and CPU matmuls copy it first (measured, 48 rows, bf16: 1.84 ms for q @ k^T on such a slice
    against 0.30 ms contiguous). The buffer is reallocated when C must grow (every 64 steps at most) or can shrink
    by two blocks.

    Duck-typed to what HF's attention modules call on a cache: `update(k, v, layer_idx, ...)` writes the step's one
    key per row at the row's own position and returns the keys to attend over."""

    def __init__(self, model: torch.nn.Module, decoder: torch.nn.Module, rows: int) -> None:
        self.model, self.decoder, self.capacity = model, decoder, rows
        self.keys = self.values = self.length = None  # allocated by the first `add`, shaped like its cache
        self.n = 0  # running rows: slots [0, n)
        self.rows: list[int] = []  # prompt index of each running row
        self.last: list[int] = []  # its last token (the next step's input)

    def _fit(self, need: int) -> None:
        """Make the key length C the multiple of SLOT_BLOCK covering `need` columns (kept if within a block)."""
        cap = self.keys.shape[3]
        new = -(-need // SLOT_BLOCK) * SLOT_BLOCK
        if cap >= need and new >= cap - SLOT_BLOCK:
            return
        keep = min(cap, new)
        shape = (*self.keys.shape[:3], new, self.keys.shape[4])
        keys, values = self.keys.new_zeros(shape), self.values.new_zeros(shape)
        keys[:, : self.n, :, :keep] = self.keys[:, : self.n, :, :keep]
        values[:, : self.n, :, :keep] = self.values[:, : self.n, :, :keep]
        self.keys, self.values = keys, values

    def add(self, cache: DynamicCache, mask: Tensor, rows: list[int], last: list[int]) -> None:
        """Append a prefilled group: `cache` holds G rows of W columns, `mask` (G, W) marks the real ones."""
        if self.keys is None:
            k = cache.layers[0].keys  # (G, KVH, W, D)
            shape = (len(cache.layers), self.capacity, k.shape[1], 0, k.shape[3])
            self.keys, self.values = (torch.zeros(shape, dtype=k.dtype, device=k.device) for _ in range(2))
            self.length = torch.zeros(self.capacity, dtype=torch.long, device=k.device)  # keys held by each row
        lengths = mask.sum(1).tolist()
        self._fit(max([*lengths, int(self.length[: self.n].max()) if self.n else 0]) + 1)
        cols = [m.nonzero()[:, 0].to(self.keys.device) for m in mask.bool()]  # a row's real columns, in order
        for layer, src in enumerate(cache.layers):
            for g, (n, c) in enumerate(zip(lengths, cols)):
                self.keys[layer, self.n + g, :, :n] = src.keys[g].index_select(1, c)
                self.values[layer, self.n + g, :, :n] = src.values[g].index_select(1, c)
        self.length[self.n : self.n + len(rows)] = torch.tensor(lengths, device=self.length.device)
        self.n += len(rows)
        self.rows, self.last = self.rows + rows, self.last + last

    def remove(self, finished: list[int]) -> None:
        """Drop running rows `finished` (indices in [0, n)): each hole takes the last running row, keys and all."""
        for r in sorted(finished, reverse=True):  # from the end, so a moved row is never one still to drop
            last = self.n - 1
            if r != last:
                n = int(self.length[last])
                self.keys[:, r, :, :n] = self.keys[:, last, :, :n]
                self.values[:, r, :, :n] = self.values[:, last, :, :n]
                self.length[r] = self.length[last]
                self.rows[r], self.last[r] = self.rows[last], self.last[last]
            self.rows.pop()
            self.last.pop()
            self.n -= 1

    def begin_step(self) -> tuple[Tensor, Tensor]:
        """Positions (n, 1) of this step's tokens and the attention mask (n, 1, 1, C), True = attend."""
        pos = self.length[: self.n]
        self._fit(int(pos.max()) + 1)
        cols = torch.arange(self.keys.shape[3], device=pos.device)
        return pos[:, None], (cols[None, :] <= pos[:, None])[:, None, None, :]

    def step(self) -> Tensor:
        """One decode step for the running rows, HF's decoder layers on this cache; their next-token logits (n, V)."""
        ids = torch.tensor(self.last, device=self.keys.device)[:, None]
        position_ids, mask = self.begin_step()
        h = self.decoder.embed_tokens(ids)
        pe = self.decoder.rotary_emb(h, position_ids)
        for layer in self.decoder.layers:
            out = layer(h, attention_mask=mask, position_ids=position_ids, cache=self, position_embeddings=pe)
            h = out[0] if isinstance(out, tuple) else out
        self.length[: self.n] += 1
        return self.model.get_output_embeddings()(self.decoder.norm(h)[:, 0])

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args: object, **kwargs: object
               ) -> tuple[Tensor, Tensor]:
        """key/value (n, KVH, 1, D): written at each row's position; returns the (n, KVH, C, D) blocks."""
        rows = torch.arange(self.n, device=key.device)
        pos = self.length[: self.n]
        self.keys[layer_idx, rows, :, pos] = key[:, :, 0]
        self.values[layer_idx, rows, :, pos] = value[:, :, 0]
        return self.keys[layer_idx, : self.n], self.values[layer_idx, : self.n]


def _slot_decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder `_Slots.step` can drive (embed_tokens, rotary_emb, layers, norm: the Llama family), or None."""
    decoder = model.get_decoder()
    if all(hasattr(decoder, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")) and not getattr(
        model.config, "sliding_window", None
    ):
        return decoder
    return None


@torch.no_grad()
def generate_refill(
    verifier: Verifier,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 32,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
    refill_at: int | None = None,
    on_done: Callable[[int, list[int]], None] | None = None,
    pack: bool = True,
    slots: bool = True,
    keys: Sequence[int] | None = None,
    order: str = "length",
    share_prefix: bool = True,
) -> list[list[int]]:
    """Answer every prompt (token ids); returns the new ids of each, ending with the stop token when it stopped.

    Args:
        stop_ids: tokens that end an answer (default: the tokenizer's EOS).
        refill_at: refill when this many slots are free (default: a quarter of the batch), so prefills come in
            groups rather than one row at a time.
        on_done: called with (prompt index, answer) as each answer finishes (progress bars).
        pack: run the model's bf16 linears through prepacked weights on a CPU (models.packed; the same tokens).
        keys: one integer per prompt that, with `seed`, seeds its random stream (default: its index); a caller
            answering part of a larger list passes the prompts' indices in it, so every part samples what one run
            over the whole list would.
        order: "length" queues the prompts shortest first (similar lengths share a prefill); "given" keeps the
            list's order (a caller that saves work in parts queues part by part, each sorted).
        share_prefix: compute the prompts' longest common prefix once, not once per prompt.
        slots: decode on the preallocated slot cache where the model allows it (`_slot_decoder`); False keeps HF's
            DynamicCache (the path every other model takes).
    """
    model, device = verifier.model, verifier.device
    stops = set(stop_ids if stop_ids is not None else [verifier.tokenizer.eos_token_id])
    pad_id = verifier.tokenizer.pad_token_id or 0
    refill_at = refill_at or max(1, batch_size // 4)
    if order not in ("length", "given"):
        raise ValueError(f"order={order!r}: use 'length' or 'given'")
    queue = list(range(len(prompts)))
    if order == "length":
        queue.sort(key=lambda i: len(prompts[i]))  # similar lengths share a prefill
    answers: list[list[int]] = [[] for _ in prompts]
    keys = list(range(len(prompts))) if keys is None else list(keys)
    gens: dict[int, torch.Generator] = {}  # the running rows' streams, made as a row joins, dropped as it leaves

    def finish(i: int) -> None:
        gens.pop(i, None)
        if on_done is not None:
            on_done(i, answers[i])

    # The prompts' longest common prefix (a chat template's system turn: 24 of the 64 tokens of an average built-in
    # prompt) is computed once; each group's prefill runs only the rest, on a cache holding the prefix for every row.
    shared = _common_prefix(prompts) if share_prefix else 0
    prefix_kv: list[tuple[Tensor, Tensor]] = []
    if shared:
        cache = DynamicCache(config=model.config)
        model.get_decoder()(input_ids=torch.tensor([prompts[queue[0]][:shared]], device=device), cache=cache,
                            use_cache=True)
        prefix_kv = [(layer.keys, layer.values) for layer in cache.layers]

    def prefill(group: list[int]) -> tuple[DynamicCache, Tensor, list[int]]:
        """The next group as one forward over its prompts after the shared prefix, left-padded: its cache, its
        (G, W) mask (prefix columns first) and each row's first token."""
        width = max(len(prompts[i]) for i in group) - shared
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)  # (G, T)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for r, i in enumerate(group):
            ids[r, width - len(prompts[i]) + shared :] = torch.tensor(prompts[i][shared:])
            mask[r, width - len(prompts[i]) + shared :] = 1
        positions = shared + (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        for layer, (k, v) in enumerate(prefix_kv):
            cache.update(k.expand(len(group), -1, -1, -1), v.expand(len(group), -1, -1, -1), layer)
        mask = torch.cat([torch.ones((len(group), shared), dtype=torch.long), mask], dim=1)
        # The decoder, then the head on the last position only: `logits_to_keep=1` hands the head a strided
        # (G, 1, D) view, which F.linear runs as a batched matmul over G copies of the vocabulary matrix
        # (measured: 10 of 22 s in a 48-prompt build).
        out = model.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device),
                                  position_ids=positions.to(device), cache=cache, use_cache=True)
        logits = model.get_output_embeddings()(out.last_hidden_state[:, -1].contiguous())  # (G, V)
        if temperature > 0:
            gens.update((i, row_generator(seed, keys[i], device)) for i in group)
        first = sample(logits, temperature, top_p, [gens.get(i) for i in group]).tolist()
        for i, t in zip(group, first):
            answers[i].append(t)
        return out.past_key_values, mask, first

    def done(i: int) -> bool:
        return answers[i][-1] in stops or len(answers[i]) >= max_new_tokens

    decoder = _slot_decoder(model) if slots else None
    running = _Slots(model, decoder, batch_size) if decoder is not None else _Batch(model)
    with decode_attention_for(model), (packed_linears(model) if pack else contextlib.nullcontext()):
        while queue or running.n:
            if queue and (batch_size - running.n >= refill_at or not running.n):
                # 1. prefill the next group; 2. it joins the running rows
                group, queue = queue[: batch_size - running.n], queue[batch_size - running.n :]
                cache, mask, first = prefill(group)
                running.add(cache, mask, list(group), first)
            else:
                # 3. one decode step for every running row
                nxt = sample(running.step(), temperature, top_p, [gens.get(i) for i in running.rows]).tolist()
                running.last = nxt
                for i, t in zip(running.rows, nxt):
                    answers[i].append(t)
            # 4. finished rows leave
            finished = [r for r, i in enumerate(running.rows) if done(i)]
            for r in finished:
                finish(running.rows[r])
            running.remove(finished)
    return answers
