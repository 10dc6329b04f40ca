"""Generation with Hugging Face transformers (CPU and GPU): batched sampling with KV reuse.

The agent loop re-sends the whole conversation every turn, so most of a turn's prompt was already
seen by the model: the long instruction every episode shares, and the episode's own previous
turns. This backend keeps those keys/values and only runs the model on what is new.

Cache layout
------------
A batch is decoded in one *slab* per layer: a preallocated ``[rows, kv_heads, capacity, head_dim]``
tensor (``_SlabCache``, a ``transformers.DynamicCache`` whose layers write in place instead of
concatenating, so a decode step does not copy the whole cache). A ``[rows, capacity]`` boolean
mask says which columns of a row hold a real token; the model sees it as the 2D attention mask,
and explicit ``position_ids`` number each row's real tokens 0, 1, 2, ... whatever the padding.
Columns are filled left to right, the same columns for every row::

    | shared  | past (gathered)    | new prompt suffix  | completion (decode)   |
    | k0 ...  | pad pad  ... k_p-1 | pad  s0 s1 ... s_m | c0 c1 ... (pad after  |
    |         |                    |                    |  the row finished)    |

``past`` is copied from KV computed earlier: the leading tokens that every row of the batch reuses
and has in common (``shared``, e.g. the instruction; at least ``min_shared_prefix`` of them, else
none) left-aligned, so they sit in the same columns of every row and attention reads them once for
all rows (`stages.common.kernels.attention.shared_prefix_attention`, on a CPU under SDPA), the rest
right-aligned, left-padded; ``suffix`` is prefilled (right-aligned, so the last column is every
row's last prompt token), then decoding appends one column per step. Padding *in the middle* of a
row is harmless: pads are masked out and skipped by the position ids, so each real token sees
exactly the tokens and positions it would see in a from-scratch prefill. Rows that finish early
leave the batch once enough of them have (their KV copied out first, then the rest into slabs of
their own, `batch_select_indices`), so late steps run narrower. On a CPU a decode step of a Llama,
Mistral or Qwen2 model runs as `stages.common.kernels.decode.DecodeStep`'s loop over the layers
instead of transformers' forward: the same arithmetic with fewer operators.

After a call, each request's key maps to a ``_Cached`` (unless the request was its episode's last
turn, `GenerationRequest.last_turn`, whose KV nothing will read): the tokens whose KV is stored
(prompt + completion minus its last token, which was sampled but never fed) and where they live
(a row of a ``_Block``, i.e. the slab as it was when the row finished; a block is freed once no
key refers to it). The next call reuses, per request, the longest prefix its prompt shares with
either

* its key's cached tokens (the previous turn of the same episode), or
* the shared prefix: the longest common prefix of the new episodes' prompts (system prompt +
  instruction), prefilled once at batch 1 and kept across calls, or
* an identical prompt of another new episode (the episodes of a group play the same puzzle, so
  their first prompts are equal, and the agent loop sends them as one n-request): each distinct
  prompt is prefilled once, its KV copied into the rows of every episode that starts from it,

and gathers those columns into the new slab. A prompt that extends nothing cached is prefilled
from scratch, so reuse only ever saves work: results equal a full prefill of each prompt (up to
float rounding, as with any change of batch shape).

The caches are only valid for the weights that produced them: when the model's parameters change
(a PPO update bumps their version counters) everything cached is dropped; ``reset()`` does it
explicitly.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from stages.agent.backends.base import (
    Completion,
    GenerationRequest,
    OnProgress,
    SamplingParams,
    all_singles,
    end_token_ids,
)
from stages.common import rss
from stages.common.errors import UserError
from stages.common.kernels import native
from stages.common.kernels.decode import DecodeStep
from stages.common.kernels.linear import PackedLinears
from stages.common.models import kept_columns
from stages.common.prefix_tree import common_prefix_len

# ---- cache -------------------------------------------------------------------------------


class _SlabLayer(DynamicLayer):
    """One layer's keys/values in preallocated ``[rows, kv_heads, capacity, head_dim]`` slabs.

    ``update`` writes the new columns in place; ``keys``/``values`` are views of the filled part.
    """

    def __init__(self, k_slab: torch.Tensor, v_slab: torch.Tensor, length: int):
        super().__init__()
        self.k_slab, self.v_slab = k_slab, v_slab
        self.dtype, self.device = k_slab.dtype, k_slab.device
        self.is_initialized = True
        self._set_length(length)

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self.k_slab[:, :, :length]
        self.values = self.v_slab[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.k_slab.shape[-2]:
            raise RuntimeError(f"KV slab overflow: {end} columns > capacity {self.k_slab.shape[-2]}")
        self.k_slab[:, :, start:end] = key_states
        self.v_slab[:, :, start:end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`: their filled columns copied into slabs of their own, so the old
        slabs, the finished rows' included (their KV already copied out), are freed at once. Rows
        moved down in place would still be views of the old slabs, keeping every row of them until
        the block stored from them is freed, on the next turn. The cache selects layer by layer, so
        one layer's survivors at a time exist twice."""
        shape = (len(indices), *self.k_slab.shape[1:])
        k_slab, v_slab = self.k_slab.new_empty(shape), self.v_slab.new_empty(shape)
        for row, source in enumerate(indices.tolist()):
            k_slab[row, :, :self.length].copy_(self.k_slab[source, :, :self.length])
            v_slab[row, :, :self.length].copy_(self.v_slab[source, :, :self.length])
        self.k_slab, self.v_slab = k_slab, v_slab
        self._set_length(self.length)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("slab layers do not crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("slab layers do not repeat")


class _SlabCache(DynamicCache):
    """A DynamicCache over preallocated slabs (see the module docstring); columns ``[0, shared)``
    hold the same tokens in every row."""

    def __init__(self, layers: list[_SlabLayer], shared: int):
        Cache.__init__(self, layers=layers)  # not DynamicCache.__init__: the layers are given
        self.shared = shared

    def model_kwargs(self) -> dict:
        """What a forward over this cache passes the model besides it: the shared columns' count,
        for `stages.common.kernels.attention.spa_sdpa` (which reads them once for all rows)."""
        return {"shared_columns": self.shared} if self.shared else {}


@dataclass
class _Block:
    """KV of a batch of token sequences: per layer ``[rows, kv_heads, columns, head_dim]`` tensors
    and a ``[rows, columns]`` CPU bool mask of the columns that hold real tokens (in order)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor


@dataclass
class _Cached:
    """A token sequence whose KV is in row ``row`` of ``block`` (its mask's true columns)."""

    tokens: list[int]
    block: _Block
    row: int


@dataclass
class _Row:
    """One request of a chunk: its prompt and the KV it starts from (``reuse`` tokens of ``source``)."""

    index: int  # position in the request list
    key: str
    prompt: list[int]
    source: _Cached | None
    reuse: int
    keep: bool = True  # its KV is kept for the episode's next turn (not after its last one)


# ---- backend -----------------------------------------------------------------------------


class HFBackend:
    """Batched generation with a transformers causal LM; see the module docstring.

    ``batch_size`` rows are decoded together (more requests go in successive chunks).
    ``prefill_tokens`` bounds rows x columns of one prefill forward (longer prompts are prefilled
    in column chunks), which bounds activation memory. ``min_shared_prefix`` is the shortest
    common prefix worth prefilling once for several new episodes. Finished rows leave the batch
    once ``drop_fraction`` of it has finished (their KV is kept aside), so late steps run narrower.

    ``stats`` counts prompt, reused, prefilled and generated tokens, decode steps and seconds
    spent in prefill and decode (``reset_stats()`` zeroes them), for benchmarks.

    Weight changes are detected by the parameters' version counters (bumped by in-place updates:
    optimizer steps, ``load_state_dict``). Code that writes through ``.data`` (DeepSpeed does) must
    call ``reset()`` or ``load_weights()`` after an update.
    """

    name = "hf"

    def __init__(self, model, tokenizer, batch_size: int = 64, prefill_tokens: int = 8192,
                 min_shared_prefix: int = 16, drop_fraction: float = 0.25):
        if batch_size < 1:
            raise UserError(f"rollout.batch_size must be at least 1, got {batch_size}")
        if not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module  # a DeepSpeed engine or DDP wrapper
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.prefill_tokens = prefill_tokens
        self.min_shared_prefix = min_shared_prefix
        self.drop_fraction = drop_fraction
        config = self.model.config.get_text_config(decoder=True)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
        if sliding or any(t != "full_attention" for t in layer_types):
            raise UserError("the hf backend supports full-attention models only (this one has sliding-window "
                            "or other attention layers); use rollout.backend=vllm")
        # SDPA takes a boolean [rows, 1, 1, columns] mask as is: passing it saves building one per step.
        self._mask_4d = getattr(self.model.config, "_attn_implementation", None) == "sdpa"
        self._layers = config.num_hidden_layers
        self._kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self._head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = end_token_ids(self.model, tokenizer)
        self._episodes: dict[str, _Cached] = {}
        self._prefix: _Cached | None = None
        self._weights = self._weights_fingerprint()
        self._linears = PackedLinears(self.model)
        self.stats: dict[str, float] = {}
        self.reset_stats()

    # ---- public API ----

    def generate(self, requests: list[GenerationRequest], params: SamplingParams,
                 progress: OnProgress | None = None) -> list[Completion]:
        """One completion per key of each request; `progress` hears of every decode step's tokens
        and of each completion as it finishes. An n-request is its singles: their one prompt is
        prefilled once and its KV gathered into each of their rows (`_share_prompts`)."""
        requests = all_singles(requests)
        if not requests:
            return []
        keys = [r.key for r in requests]
        if len(set(keys)) != len(keys):
            raise ValueError("generate() got the same key twice in one call")
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"request {r.key!r} has an empty prompt")
        report = progress or _ignore
        if params.max_new_tokens <= 0:
            report(0, len(requests))
            return [Completion([], "", [], "length") for _ in requests]
        weights = self._weights_fingerprint()
        if weights != self._weights:
            self.reset()
            self._weights = weights
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode(), self._linears.active(), self._heap():
                return self._generate(requests, params, report)
        finally:
            model.train(was_training)
            if was_training:
                self._linears.drop()  # a model in training changes before the next call

    def release(self, keys: list[str]) -> None:
        for key in keys:
            self._episodes.pop(key, None)

    def reset(self) -> None:
        """Forget every cached KV (episodes and shared prefix), e.g. after the weights changed."""
        self._episodes.clear()
        self._prefix = None
        self._linears.drop()

    def close(self) -> None:
        """Drop the caches (the model is its owner's)."""
        self.reset()

    def load_weights(self, named_tensors) -> None:
        """Same call as the vLLM backend's: copy in weights that are not already the model's own
        tensors (a live actor's are), then drop the caches computed with the old ones."""
        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = own[name]
                if target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor)
        self.reset()
        self._weights = self._weights_fingerprint()

    def reset_stats(self) -> None:
        self.stats = {"prompt_tokens": 0, "reused_tokens": 0, "prefilled_tokens": 0, "generated_tokens": 0,
                      "decode_steps": 0, "prefill_s": 0.0, "decode_s": 0.0}

    # ---- one call ----

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _generate(self, requests: list[GenerationRequest], params: SamplingParams,
                  report: OnProgress) -> list[Completion]:
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        rows = [self._plan(i, r) for i, r in enumerate(requests)]
        self._share_prompts(rows)
        out: list[Completion | None] = [None] * len(requests)
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            for row, completion in zip(chunk, self._run_chunk(chunk, params, generator, report)):
                out[row.index] = completion
        return out  # type: ignore[return-value]

    def _plan(self, index: int, request: GenerationRequest) -> _Row:
        prompt = list(request.prompt_ids)
        cached = self._episodes.get(request.key)
        reuse = 0
        if cached is not None:
            reuse = min(common_prefix_len(prompt, cached.tokens), len(prompt) - 1)
        self.stats["prompt_tokens"] += len(prompt)
        return _Row(index, request.key, prompt, cached if reuse > 0 else None, reuse, keep=not request.last_turn)

    def _share_prompts(self, rows: list[_Row]) -> None:
        """Let new episodes share work: point rows that reuse little of their own episode at the
        shared prefix (prefilled, or extended, first when several of them start alike), then
        prefill each prompt that several rows have in full (a group playing one puzzle) once."""
        fresh = [row for row in rows if row.reuse < self.min_shared_prefix]
        if len(fresh) >= 2:
            first = fresh[0].prompt
            length = min(len(row.prompt) for row in fresh) - 1
            for row in fresh[1:]:
                length = min(length, common_prefix_len(first, row.prompt))
            if length >= self.min_shared_prefix:
                self._ensure_prefix(first[:length])
        prefix = self._prefix
        if prefix is not None:
            for row in rows:
                reuse = min(common_prefix_len(row.prompt, prefix.tokens), len(row.prompt) - 1)
                if reuse >= self.min_shared_prefix and reuse > row.reuse:
                    row.source, row.reuse = prefix, reuse
        same: dict[tuple[int, ...], list[_Row]] = {}
        for row in fresh:
            same.setdefault(tuple(row.prompt), []).append(row)
        groups = [members for members in same.values()
                  if len(members) > 1 and members[0].reuse < len(members[0].prompt) - 1]
        for start in range(0, len(groups), self.batch_size):
            chunk = groups[start:start + self.batch_size]
            unique = [_Row(-1, "", g[0].prompt, g[0].source, g[0].reuse) for g in chunk]
            block = self._prefill_block(unique)
            for j, members in enumerate(chunk):
                cached = _Cached(members[0].prompt[:-1], block, j)
                for row in members:
                    row.source, row.reuse = cached, len(row.prompt) - 1

    def _prefill_block(self, rows: list[_Row]) -> _Block:
        """KV of each row's prompt but its last token, as a block (nothing is sampled)."""
        start = time.perf_counter()
        cache, mask = self._prefill(rows, extra_columns=0, keep_last=False)
        self.stats["prefill_s"] += time.perf_counter() - start
        return _Block([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], mask.cpu())

    def _ensure_prefix(self, tokens: list[int]) -> None:
        old = self._prefix
        if old is not None and old.tokens[:len(tokens)] == tokens:
            return  # already cached (possibly longer: rows reuse only what they share)
        row = _Row(-1, "", tokens + [self.pad_id], None, 0)  # the extra token is never fed
        if old is not None:
            reuse = common_prefix_len(tokens, old.tokens)
            if reuse > 0:
                row.source, row.reuse = old, reuse
        self._prefix = _Cached(tokens, self._prefill_block([row]), 0)

    # ---- prefill ----

    def _prefill(self, rows: list[_Row], extra_columns: int, keep_last: bool = True):
        """Build the slab for `rows`: gather their reused KV, then run the model on the rest.

        Returns (cache, device mask [rows, capacity]) and, with keep_last, the logits after each
        prompt. With keep_last=False the last prompt token is not fed (used for the prefix).
        """
        device, dtype = self.device, next(self.model.parameters()).dtype
        n = len(rows)
        past = max(row.reuse for row in rows)
        shared = self._shared_columns(rows)
        suffixes = [row.prompt[row.reuse:] if keep_last else row.prompt[row.reuse:-1] for row in rows]
        width = max(len(s) for s in suffixes)
        capacity = past + width + extra_columns
        shape = (n, self._kv_heads, capacity, self._head_dim)
        layers = [_SlabLayer(torch.empty(shape, dtype=dtype, device=device),
                             torch.empty(shape, dtype=dtype, device=device), past)
                  for _ in range(self._layers)]
        cache = _SlabCache(layers, shared)
        mask = torch.zeros(n, capacity, dtype=torch.bool)
        self._gather_past(rows, layers, mask, past, shared)

        # The suffix, right-aligned in columns [past, past + width).
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        pos = torch.zeros((n, width), dtype=torch.long)
        for i, (row, suffix) in enumerate(zip(rows, suffixes)):
            if suffix:
                ids[i, width - len(suffix):] = torch.tensor(suffix)
                pos[i, width - len(suffix):] = torch.arange(row.reuse, row.reuse + len(suffix))
                mask[i, past + width - len(suffix):past + width] = True
        self.stats["reused_tokens"] += sum(row.reuse for row in rows if row.index >= 0)
        self.stats["prefilled_tokens"] += sum(len(s) for s in suffixes)
        mask_dev = mask.to(device)
        ids, pos = ids.to(device), pos.to(device)
        step = max(1, self.prefill_tokens // n)
        logits = None
        for lo in range(0, width, step):
            hi = min(width, lo + step)
            out = self.model(input_ids=ids[:, lo:hi], position_ids=pos[:, lo:hi],
                             attention_mask=mask_dev[:, :past + hi], past_key_values=cache,
                             use_cache=True, logits_to_keep=kept_columns(hi - lo - 1, hi - lo, device),
                             **cache.model_kwargs())
            logits = out.logits[:, -1]
        if keep_last:
            return cache, mask_dev, logits
        return cache, mask_dev

    def _shared_columns(self, rows: list[_Row]) -> int:
        """How many leading tokens every row reuses and has in common with the others (0 below
        `min_shared_prefix`, for a single row, off a CPU or off SDPA, whose registered function
        is what reads them once): their KV is the same in every row (equal tokens at equal
        positions under the same weights), so the slab puts them in the same columns and
        attention reads them once for all rows."""
        if len(rows) < 2 or self.device.type != "cpu" or not self._mask_4d:
            return 0
        first = rows[0].prompt
        shared = min(min(row.reuse, common_prefix_len(first, row.prompt)) for row in rows)
        return shared if shared >= self.min_shared_prefix else 0

    def _gather_past(self, rows: list[_Row], layers: list[_SlabLayer], mask: torch.Tensor, past: int,
                     shared: int) -> None:
        """Fill columns [0, past) of the slabs: each row's first `shared` reused tokens' KV
        left-aligned (the same columns in every row), the rest of its reused KV right-aligned, its
        padding copied from its first real column (finite values, masked out); rows reusing nothing
        get zeros. The slabs come from torch.empty, so every column is written before it is read."""
        if past == 0:
            return
        device = self.device
        by_block: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            if row.source is None:
                for layer in layers:
                    layer.k_slab[i, :, :past] = 0
                    layer.v_slab[i, :, :past] = 0
            else:
                by_block.setdefault(id(row.source.block), []).append(i)
                mask[i, :shared] = True
                mask[i, past - (row.reuse - shared):past] = True
        for members in by_block.values():
            block = rows[members[0]].source.block
            sources = []  # per member: its row of the block, and the block column behind each slab column
            for i in members:
                tail = rows[i].reuse - shared
                cols = block.mask[rows[i].source.row].nonzero()[:rows[i].reuse, 0]
                src_cols = torch.empty(past, dtype=torch.long)
                src_cols[:shared] = cols[:shared]
                src_cols[past - tail:] = cols[shared:]
                src_cols[shared:past - tail] = cols[0]
                sources.append((i, rows[i].source.row, src_cols.to(device)))
            for layer, keys, values in zip(layers, block.keys, block.values):
                # Row by row along the column axis: contiguous head_dim runs, unlike an indexed
                # assignment over (row, column) pairs, which is several times slower on a CPU.
                for i, src_row, src_cols in sources:
                    layer.k_slab[i, :, :past] = keys[src_row].index_select(1, src_cols)
                    layer.v_slab[i, :, :past] = values[src_row].index_select(1, src_cols)

    # ---- decode ----

    def _run_chunk(self, rows: list[_Row], params: SamplingParams, generator, report: OnProgress) -> list[Completion]:
        start = time.perf_counter()
        cache, mask, logits = self._prefill(rows, extra_columns=params.max_new_tokens)
        self.stats["prefill_s"] += time.perf_counter() - start
        start = time.perf_counter()
        device = self.device
        n = len(rows)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[str] = ["length"] * n
        stop_check = self._stop_checker(params.stop)
        batch = list(range(n))  # the chunk row in each batch row
        alive = [True] * n  # per batch row: still generating
        pos = torch.tensor([len(row.prompt) for row in rows], device=device)[:, None]
        column = cache.layers[0].length  # next slab column to fill
        decode_step = DecodeStep(self.model) if device.type == "cpu" and DecodeStep.applies(self.model) else None
        for step in range(params.max_new_tokens):
            token, logprob = _sample(logits, params, generator)
            token_list, logprob_list = token.tolist(), logprob.tolist()
            sampled = sum(alive)
            newly_finished = False
            for b, i in enumerate(batch):
                if not alive[b]:
                    continue
                t = token_list[b]
                tokens[i].append(t)
                logprobs[i].append(logprob_list[b])
                if t in self.eos_ids:
                    finish[i] = "eos"
                elif stop_check is not None and stop_check(t, tokens[i]):
                    finish[i] = "stop"
                else:
                    continue
                alive[b] = False
                newly_finished = True
            report(sampled, sampled - sum(alive))
            if step == params.max_new_tokens - 1 or not any(alive):
                break
            if newly_finished:
                dead = [b for b in range(len(batch)) if not alive[b]]
                if len(dead) >= max(1, int(self.drop_fraction * len(batch))):
                    # Keep the finished rows' KV aside and continue with the others only.
                    self._store(rows, tokens, [batch[b] for b in dead], cache, mask, column, dead)
                    keep = torch.tensor([b for b in range(len(batch)) if alive[b]], device=device)
                    cache.batch_select_indices(keep)
                    mask, pos, token = mask[keep], pos[keep], token[keep]
                    batch = [batch[b] for b in keep.tolist()]
                    alive = [True] * len(batch)
                    mask[:, column] = True
                else:
                    mask[:, column] = torch.tensor(alive, device=device)
            else:
                mask[:, column] = True
            attention = mask[:, None, None, :column + 1] if self._mask_4d else mask[:, :column + 1]
            if decode_step is not None:
                logits = decode_step(token[:, None], pos, cache, attention, cache.shared)
            else:
                out = self.model(input_ids=token[:, None], position_ids=pos, attention_mask=attention,
                                 past_key_values=cache, use_cache=True, logits_to_keep=1, **cache.model_kwargs())
                logits = out.logits[:, -1]
            pos += 1
            column += 1
            self.stats["decode_steps"] += 1
        report(0, sum(alive))  # the rows cut at max_new_tokens
        self._store(rows, tokens, batch, cache, mask, column, None)
        self.stats["decode_s"] += time.perf_counter() - start
        completions = []
        for i in range(n):
            self.stats["generated_tokens"] += len(tokens[i])
            text = self.tokenizer.decode(tokens[i], skip_special_tokens=True)
            completions.append(Completion(tokens[i], text, logprobs[i], finish[i]))
        return completions

    def _store(self, rows, tokens, members, cache, mask, column, batch_rows) -> None:
        """Remember, per finished row, the tokens whose KV is cached (prompt + completion minus its
        last token, never fed) and where: batch rows `batch_rows` of the slab (copied out), or the
        whole slab (viewed, batch_rows None). Rows after their episode's last turn keep nothing."""
        kept = [(slab_row, i) for slab_row, i in enumerate(members) if rows[i].keep]
        if not kept:
            return
        if batch_rows is None:
            keys = [layer.k_slab[:, :, :column] for layer in cache.layers]
            values = [layer.v_slab[:, :, :column] for layer in cache.layers]
            block = _Block(keys, values, mask[:, :column].cpu())
        else:
            index = torch.tensor([batch_rows[slab_row] for slab_row, _ in kept], device=self.device)
            keys = [layer.k_slab[:, :, :column].index_select(0, index) for layer in cache.layers]
            values = [layer.v_slab[:, :, :column].index_select(0, index) for layer in cache.layers]
            block = _Block(keys, values, mask[index, :column].cpu())
            kept = [(block_row, i) for block_row, (_, i) in enumerate(kept)]  # the copy's rows
        for block_row, i in kept:
            self._episodes[rows[i].key] = _Cached(rows[i].prompt + tokens[i][:-1], block, block_row)

    # ---- helpers ----

    def _stop_checker(self, stops: tuple[str, ...]):
        """A function (token, completion so far) -> True when the completion now contains a stop string."""
        stops = tuple(s for s in stops if s)
        if not stops:
            return None
        candidates = _tokens_containing(self.tokenizer, {s[-1] for s in stops})
        tail = max(len(s) for s in stops) + 2
        decode = self.tokenizer.decode

        def check(token: int, completion: list[int]) -> bool:
            if candidates is not None and token not in candidates:
                return False
            text = decode(completion[-tail:], skip_special_tokens=True)
            return any(s in text for s in stops)

        return check

    def _heap(self):
        """On a CPU, the tensors of each forward come from the heap the previous forward freed
        (`stages.common.rss.blocks_kept_in_heap`), not from fresh mappings."""
        return rss.blocks_kept_in_heap() if self.device.type == "cpu" else contextlib.nullcontext()

    def _weights_fingerprint(self) -> tuple[int, int]:
        version = ptr = 0
        for p in self.model.parameters():
            version += p._version
            ptr += p.data_ptr()
        return version, ptr


# ---- functions ---------------------------------------------------------------------------


def _ignore(tokens: int, completions: int) -> None:
    """The progress report of a caller that asked for none."""


def _sample(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (in the model's dtype); return it and its log-prob
    under the distribution sampled from.

    temperature 0 is greedy; its log-prob is then that of the untempered model distribution. A draw
    inverts the cumulative distribution at one uniform per row (on a CPU much faster than
    torch.multinomial, which draws an exponential per vocabulary entry); on a CPU without top-p,
    `native.sample` does it in one C call, at the same uniforms.
    """
    greedy = params.temperature <= 0
    uniforms = None if greedy else torch.rand(logits.shape[0], generator=generator, device=logits.device)
    if greedy or params.top_p >= 1.0:
        drawn = native.sample(logits, params.temperature, uniforms)
        if drawn is not None:
            return drawn
    logits = logits.float()
    if greedy:
        logp = torch.log_softmax(logits, dim=-1)
        token = logits.argmax(dim=-1)
    else:
        scaled = logits / params.temperature
        if params.top_p < 1.0:
            scaled = _top_p_filter(scaled, params.top_p)
        logp = torch.log_softmax(scaled, dim=-1)
        token = _sample_categorical(logp.exp(), uniforms)
    return token, logp.gather(1, token[:, None]).squeeze(1)


def _sample_categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds the row's uniform times the total."""
    cdf = probs.cumsum(dim=-1)
    token = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).squeeze(1)
    token = token.clamp_(max=probs.shape[1] - 1)
    # Rounding can land on a zero-probability token at the very end; take the mode then.
    ok = probs.gather(1, token[:, None]).squeeze(1) > 0
    return torch.where(ok, token, probs.argmax(dim=-1))


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


_TOKENS_CONTAINING: dict[tuple, frozenset[int] | None] = {}


def _tokens_containing(tokenizer, chars: set[str]) -> frozenset[int] | None:
    """Ids of the tokens whose text contains one of `chars` (only tokens that can complete a stop
    string need a check); None (check every token) when a char is not ASCII, since byte-level
    tokens may split it. Cached per vocabulary: decoding it takes ~0.5 s."""
    if any(ord(c) > 127 for c in chars):
        return None
    key = (type(tokenizer).__name__, getattr(tokenizer, "name_or_path", ""), len(tokenizer), frozenset(chars))
    if key not in _TOKENS_CONTAINING:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=True)
        _TOKENS_CONTAINING[key] = frozenset(i for i, text in enumerate(texts) if any(c in text for c in chars))
    return _TOKENS_CONTAINING[key]
