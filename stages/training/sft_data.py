"""SFT data: chat rows -> token ids + loss masks, and the micro-batch plan that feeds the trainer.

Masks (the paper's eq. 2). Every conversation is rendered through the model's OWN chat template
(`apply_chat_template(..., tokenize=False)`) and tokenized once with character offsets, which is
exactly what `apply_chat_template(tokenize=True)` produces. Each trained assistant message is then
located in the rendered text (anchored by rendering the conversation prefix with the generation
prompt, else by an in-order search), and a token is trained when it overlaps the message content
or is the template's end-of-turn token: the first special token after the content (`<|im_end|>`,
`<|eot_id|>`, `<end_of_turn>`, `</s>`), with anything the template writes between the two. Nothing
of the system/user messages or of the assistant header is trained. An assistant message is trained
unless it says `"train": false` (rows without the flag, e.g. from other tools, train every turn). No per-model token ids are
involved, so ChatML (SmolLM2, Qwen), Llama-3 and other templates work alike. A template that
rewrites assistant text (Qwen3 drops the `<think>` of past turns) cannot be matched: that row
stops with a UserError that suggests one row per turn (`clean.unit=turn`).

State text (`state_text`, the contents of `<observation>...</observation>` and
`<prediction>...</prediction>` in assistant messages):

* "trained" (default, the paper's method, eq. 2): the true states are text like any other, and
  trained in trained turns, unlike SPA's released trainer;
* "masked" (the paper's Fig. 4 ablation, what SPA's released trainer does): every such content, in
  the trained turn and in the earlier assistant turns of the context, becomes the placeholder
  `[MASKED]` (`MASK_PLACEHOLDER`) before tokenization, and the placeholder's tokens get no loss.
  So the model never sees a true state in its own turns (the game's "State:" in the user
  messages is the observation and stays) and is never trained to write one. Differences from
  SPA's trainer: the placeholder is text, not an added special token (no new embedding row, so
  checkpoints keep the base model's vocabulary), and the tags stay and are trained, so the model
  still writes the format every parser looks for (SPA replaces tags and content by one token);
* "placeholder" (the format control, not in the paper): the same `[MASKED]` text as "masked", its
  tokens trained like any other, so the model learns to write the world-model format with no state
  in it. RL from it against RL from "trained" separates the world model's share of SPA's gain from
  the format's, where "masked" leaves a small model without the format at all.

SPA's released parquet rows (`stages.common.spa_data`) are read like our JSONL rows (`read_rows`).

Tokens after the last trained one are cut (they carry no loss: a trailing untrained turn, the
template's final newline). Over-long rows are then left-truncated to `max_length` (the end of the
conversation is kept, as in the paper's config) and counted; a row left with no trained token (or
whose assistant messages all say `"train": false`) is dropped and counted. A row without an
assistant message is an error.

Batching. The rows of a micro-batch become one sequence. With `share_prefix` (the default, on
spa's SDPA attention) they are laid out as a prefix tree (`stages.common.prefix_tree`): the system
prompt and instruction every row begins with, and the turns a trajectory's turn rows repeat, are
computed once, and no attention between rows is computed; micro-batches hold up to
`micro_batch_tokens` computed tokens (on a CPU with plain torch `spa sft` makes a step's rows one
tree and trains it node by node, holding one row's activations at a time:
`stages.training.tree_passes`). Without it, under flash-attention 2, restarting
`position_ids` select the varlen kernel, which skips cross-row work, and rows are packed
(first-fit decreasing) up to `micro_batch_tokens`; elsewhere each micro-batch is one row
(`packing` overrides). Either way each row's trained tokens keep their row (``rows`` in
`collate`), so the step's loss is the aggregate `sft.loss_agg` names over the global batch
(`stages.training.loss_agg`) and how rows are grouped never changes the objective.
"""

from __future__ import annotations

import random
import typing
from dataclasses import dataclass, field
from pathlib import Path

from stages.agent.parsing import STATE_PATTERNS, state_spans
from stages.common import spa_data
from stages.common.artifacts import read_jsonl
from stages.common.config import StateText
from stages.common.errors import UserError
from stages.common.prefix_tree import common_prefix_len

ROLES = ("system", "user", "assistant", "tool")
STATE_TEXT = typing.get_args(StateText)
#: What "masked" writes in place of every observation and prediction (the paper's "[MASKED]").
MASK_PLACEHOLDER = "[MASKED]"


@dataclass
class Example:
    """One tokenized row. `mask[t] == 1` means token t is a training target (predicted from t-1)."""

    id: str
    input_ids: list[int]
    mask: list[int]
    truncated: int = 0  # tokens cut from the left
    source: str = ""  # the trajectory the row comes from (`source_id`); its turn rows share prefixes

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained(self) -> int:
        return sum(self.mask)


@dataclass
class DataStats:
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_empty: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    longest: int = 0
    dropped_ids: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        out = dict(vars(self))
        out["dropped_ids"] = self.dropped_ids[:20]
        return out


# ---- reading rows ------------------------------------------------------------------------------


def read_rows(path: str | Path, what: str = "training data") -> list[dict]:
    """The rows of an SFT file (our JSONL, or SPA's parquet), each checked to be a chat with at least
    one assistant turn."""
    if spa_data.is_parquet(path):
        return spa_data.read_rows(path)
    rows, _ = read_jsonl(path, required=("messages",))
    if not rows:
        raise UserError(f"{what} {path} has no rows; write it with `spa clean` (or check the path)")
    for number, row in enumerate(rows, 1):
        _check_row(row, f"{path} row {number}")
    return rows


def _check_row(row: dict, where: str) -> None:
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise UserError(f"{where}: message {i} must be an object with a string 'content'")
        if message.get("role") not in ROLES:
            raise UserError(f"{where}: message {i} has role {message.get('role')!r}; expected one of "
                            f"{', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where} has no assistant message, so nothing to train on; "
                        "SFT rows come from `spa clean`")


def row_id(row: dict, index: int) -> str:
    return str(row.get("id", f"row-{index}"))


# ---- masks -------------------------------------------------------------------------------------


def mask_states(messages: list[dict]) -> list[dict]:
    """The messages with every observation and prediction content of the assistant messages
    replaced by `MASK_PLACEHOLDER` (tags kept), the user and system messages as they are."""
    def masked(content: str) -> str:
        for pattern in STATE_PATTERNS.values():
            content = pattern.sub(lambda m: m.group(1) + MASK_PLACEHOLDER + m.group(3), content)
        return content

    return [{**m, "content": masked(m["content"])} if m["role"] == "assistant" else m for m in messages]


def tokenize_row(tokenizer, messages: list[dict], max_length: int, state_text: str = "trained",
                 row: str = "row") -> Example:
    """Token ids and loss mask of one conversation (see the module docstring for the rules, and
    for `state_text`); `row` names it in the Example and in errors."""
    if state_text not in STATE_TEXT:
        raise ValueError(f"state_text must be one of {', '.join(STATE_TEXT)}, got {state_text!r}")
    if state_text != "trained":
        messages = mask_states(messages)
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    mask = [0] * len(ids)
    trained = [m["role"] == "assistant" and bool(m.get("train", True)) for m in messages]
    spans = _message_spans(tokenizer, chat, text, f"row {row}", trained)
    special = _special_ids(tokenizer)
    for i in range(len(messages)):
        if not trained[i] or spans[i] is None:
            continue
        start, end = spans[i]
        limit = _next_start(spans, i, len(text))
        _mark_turn(mask, ids, offsets, start, end, limit, special)
        if state_text == "masked":  # the placeholders carry no loss
            for lo, hi in state_spans(text, start, end):
                _mark(mask, offsets, lo, hi, 0)
    mask[0] = 0  # the first token has no context to be predicted from
    end = max((t + 1 for t, m in enumerate(mask) if m), default=len(ids))
    # tokens after the last trained one feed no loss: cut them (and before the left truncation,
    # so more context is kept)
    return _truncate_left(Example(row, ids[:end], mask[:end]), max_length)


def _message_spans(tokenizer, chat: list[dict], text: str, row: str,
                   trained: list[bool]) -> list[tuple[int, int] | None]:
    """Character span of every message's content in the rendered text, searched in order. None for
    empty content and for a message the template does not render verbatim (some templates drop or
    merge system prompts), which is an error only for a trained message."""
    spans: list[tuple[int, int] | None] = []
    cursor = 0
    for i, message in enumerate(chat):
        content = message["content"]
        if not content.strip():
            spans.append(None)
            continue
        low = cursor
        if message["role"] == "assistant":
            low = max(low, _prefix_anchor(tokenizer, chat[:i], text))
        start, found = _find_content(text, content, low)
        if start < 0 and not trained[i]:
            spans.append(None)
            continue
        if start < 0:
            raise UserError(f"{row}: the chat template does not reproduce message {i} ({message['role']}) "
                            "verbatim, so its loss mask cannot be found; templates that rewrite past "
                            "assistant turns need one row per turn (spa clean --unit turn)")
        spans.append((start, start + len(found)))
        cursor = start + len(found)
    return spans


def _prefix_anchor(tokenizer, prefix: list[dict], text: str) -> int:
    """Where the assistant content must start: after the rendered prefix + generation prompt, when
    that render is a prefix of the whole conversation (true of ChatML, Llama-3, Gemma...)."""
    if not prefix:
        return 0
    from jinja2 import TemplateError

    try:
        head = tokenizer.apply_chat_template(prefix, tokenize=False, add_generation_prompt=True)
    except (TemplateError, ValueError, TypeError):  # a template may refuse a partial conversation
        return 0
    return len(head) if text.startswith(head) else 0


def _find_content(text: str, content: str, low: int) -> tuple[int, str]:
    start = text.find(content, low)
    if start >= 0:
        return start, content
    stripped = content.strip()  # e.g. Llama-3 renders `content | trim`
    return text.find(stripped, low), stripped


def _next_start(spans: list[tuple[int, int] | None], i: int, default: int) -> int:
    return next((s[0] for s in spans[i + 1:] if s is not None), default)


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return ids


def _mark_turn(mask: list[int], ids: list[int], offsets: list[tuple[int, int]], start: int, end: int,
               limit: int, special: set[int]) -> None:
    """Train the content [start, end) and what follows it up to the first special token (the
    end-of-turn), never reaching into the next message's content at `limit`."""
    _mark(mask, offsets, start, end, 1)
    for t, (lo, _hi) in enumerate(offsets):
        if lo < end or lo >= limit:
            continue
        mask[t] = 1
        if ids[t] in special:
            return
    # No special token before the next message: the template has no end-of-turn token, so only the
    # content is trained (the trailing text is the next header). Undo the tokens marked past `end`.
    for t, (lo, _hi) in enumerate(offsets):
        if end <= lo < limit:
            mask[t] = 0


def _mark(mask: list[int], offsets: list[tuple[int, int]], start: int, end: int, value: int) -> None:
    """Set the mask of every token overlapping the characters [start, end)."""
    for t, (lo, hi) in enumerate(offsets):
        if lo < end and hi > start and hi > lo:
            mask[t] = value


def _truncate_left(example: Example, max_length: int) -> Example:
    cut = len(example.input_ids) - max_length
    if cut <= 0:
        return example
    mask = example.mask[cut:]
    mask[0] = 0
    return Example(example.id, example.input_ids[cut:], mask, truncated=cut)


def tokenize_rows(rows: list[dict], tokenizer, max_length: int, state_text: str = "trained"
                  ) -> tuple[list[Example], DataStats]:
    """Tokenize every row; rows left without a trained token are dropped and counted."""
    examples, stats = [], DataStats(rows=len(rows))
    for index, row in enumerate(rows):
        rid = row_id(row, index)
        example = tokenize_row(tokenizer, row["messages"], max_length, state_text, row=rid)
        example.source = str(row.get("source_id", rid))
        if example.trained == 0:
            stats.dropped_empty += 1
            stats.dropped_ids.append(rid)
            continue
        stats.truncated += example.truncated > 0
        examples.append(example)
        stats.kept += 1
        stats.tokens += len(example)
        stats.trained_tokens += example.trained
        stats.longest = max(stats.longest, len(example))
    return examples, stats


# ---- the batch plan ----------------------------------------------------------------------------


@dataclass
class MicroBatch:
    rows: list[int]
    weight: float = 1.0  # 0 for a filler that keeps ranks in step (its loss is multiplied by 0)
    tokens: int = 0  # the tokens its forward computes


def epoch_steps(n_rows: int, epoch: int, seed: int, global_batch: int,
                sources: list[str] | None = None) -> list[list[int]]:
    """Row indices of every optimizer step of one epoch: a seeded shuffle cut into global batches
    (the last one may be smaller). A pure function of (seed, epoch), so resume needs no RNG state.

    With `sources` (each row's trajectory), the trajectories are shuffled and each one's rows stay
    together, in order, so that a trajectory's turn rows mostly land in one step, where prefix
    sharing computes their common tokens once; rows of distinct trajectories come out in the same
    order as the plain shuffle."""
    if sources is None:
        order = list(range(n_rows))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    else:
        rows_of: dict[str, list[int]] = {}
        for index, source in enumerate(sources):
            rows_of.setdefault(source, []).append(index)
        groups = list(rows_of.values())
        random.Random(seed * 1_000_003 + epoch).shuffle(groups)
        order = [index for group in groups for index in group]
    return [order[i:i + global_batch] for i in range(0, n_rows, global_batch)]


def rank_micro_batches(examples: list[Example], rank: int, world: int, micro_batch_tokens: int,
                       pack: bool = False, share: bool = False) -> list[MicroBatch]:
    """This rank's micro-batches of one optimizer step (`examples`: the step's rows; a MicroBatch
    names them by index). Rows go to ranks by balanced token load; every rank gets the same number
    of micro-batches (ZeRO's collectives run per backward), padded with zero-weight fillers where a
    rank has fewer.

    With `share` a rank's rows are taken in token order (rows that begin alike side by side) and
    cut into micro-batches whose prefix tree (`stages.common.prefix_tree`) holds at most
    ``micro_batch_tokens`` tokens and whose trained positions (where the LM head runs, once per row
    even on shared tokens) are at most as many (a longer row goes alone). The rows of a step stay those the
    seeded shuffle chose; only their grouping into micro-batches changes, and the loss, the
    step's aggregate over its rows (`stages.training.loss_agg`), does not depend on it. Without `share`:
    rows packed first-fit decreasing up to the budget (`pack`, for flash-attention 2's varlen
    kernel), else one row per micro-batch."""
    plans = step_plan(examples, world, micro_batch_tokens, pack, share)
    most = max(len(p) for p in plans)
    shortest = min(range(len(examples)), key=lambda j: (len(examples[j]), j))
    mine = plans[rank]
    return mine + [MicroBatch([shortest], 0.0) for _ in range(most - len(mine))]


def step_plan(examples: list[Example], world: int, micro_batch_tokens: int, pack: bool = False,
              share: bool = False) -> list[list[MicroBatch]]:
    """Every rank's micro-batches of one step, without fillers (`rank_micro_batches`)."""
    lengths = [len(e) for e in examples]
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for r in sorted(range(len(examples)), key=lambda j: (-lengths[j], j)):
        k = min(range(world), key=lambda w: (load[w], w))
        shares[k].append(r)
        load[k] += lengths[r]
    if share:
        return [_shared_micro_batches(part, examples, micro_batch_tokens) for part in shares]
    return [_micro_batches(part, lengths, micro_batch_tokens, pack) for part in shares]


def _shared_micro_batches(rows: list[int], examples: list[Example], budget: int) -> list[MicroBatch]:
    batches: list[MicroBatch] = []
    previous: list[int] = []
    scored = 0  # the trained positions of the last micro-batch
    for r in sorted(rows, key=lambda j: (examples[j].input_ids, j)):
        tokens = examples[r].input_ids
        added = len(tokens) - common_prefix_len(previous, tokens)  # sorted: the tree's growth
        if batches and max(batches[-1].tokens + added, scored + examples[r].trained) <= budget:
            batches[-1].rows.append(r)
            batches[-1].tokens += added
            scored += examples[r].trained
        else:
            batches.append(MicroBatch([r], tokens=len(tokens)))
            scored = examples[r].trained
        previous = tokens
    return batches


def _micro_batches(rows: list[int], lengths: list[int], budget: int, pack: bool) -> list[MicroBatch]:
    if not pack:
        return [MicroBatch([r], tokens=lengths[r]) for r in rows]
    bins: list[tuple[int, list[int]]] = []  # first-fit decreasing (rows arrive longest first)
    for r in rows:
        for i, (used, members) in enumerate(bins):
            if used + lengths[r] <= budget:
                bins[i] = (used + lengths[r], members + [r])
                break
        else:
            bins.append((lengths[r], [r]))
    return [MicroBatch(members, tokens=used) for used, members in bins]


def collate(examples: list[Example], device="cpu", share: bool = False) -> dict:
    """The model inputs of one micro-batch as one sequence, ids ``[1, T]`` and position_ids
    ``[1, T]``, with the positions whose next token is trained (``keep``, for
    `logits_to_keep`), those next tokens (``targets``) and the row (index into `examples`) each
    target belongs to (``rows``: per-row losses stay addressable).

    Without `share` the rows follow one another with restarting position ids; with it they are
    packed as a prefix tree (`stages.common.prefix_tree`), its attention structure as ``layout``
    and a placeholder 4D ``attention_mask`` (the model's attention reads the layout:
    `stages.common.kernels.attention.spa_sdpa`)."""
    import torch

    from stages.common import prefix_tree

    if share:
        packed = prefix_tree.pack([ex.input_ids for ex in examples])
        ids, positions, where = packed.ids, packed.positions, packed.where
    else:
        ids = [token for ex in examples for token in ex.input_ids]
        positions = [p for ex in examples for p in range(len(ex))]
        starts = [0]
        for ex in examples:
            starts.append(starts[-1] + len(ex))
        where = [range(start, start + len(ex)) for start, ex in zip(starts, examples)]
    keep, targets, rows = [], [], []
    for r, (ex, index) in enumerate(zip(examples, where, strict=True)):
        # mask[0] is always 0, so a target never crosses into another row
        trained = [t for t in range(1, len(ex)) if ex.mask[t]]
        keep.extend(index[t - 1] for t in trained)
        targets.extend(ex.input_ids[t] for t in trained)
        rows.extend([r] * len(trained))
    as_long = {"dtype": torch.long, "device": device}
    batch = {
        "input_ids": torch.tensor([ids], **as_long),
        "position_ids": torch.tensor([positions], **as_long),
        "keep": torch.tensor(keep, **as_long),
        "targets": torch.tensor(targets, **as_long),
        "rows": torch.tensor(rows, **as_long),
    }
    if share:
        batch["attention_mask"] = prefix_tree.placeholder_mask(len(ids), device)
        batch["layout"] = prefix_tree.TreeLayout(packed.nodes, device)
    return batch


# ---- dry run -----------------------------------------------------------------------------------

OPEN, CLOSE = "[[TRAIN]]", "[[/TRAIN]]"


def describe(example: Example, tokenizer) -> str:
    """The row decoded with every trained span wrapped in [[TRAIN]]...[[/TRAIN]], then token by token."""
    lines = [f"=== row {example.id}: {len(example)} tokens, {example.trained} trained"
             + (f", {example.truncated} cut from the left" if example.truncated else "") + " ===", ""]
    pieces, run, state = [], [], 0
    for tid, m in zip(example.input_ids, example.mask):
        if m != state:
            pieces.append(tokenizer.decode(run))
            pieces.append(OPEN if m else CLOSE)
            run, state = [], m
        run.append(tid)
    pieces.append(tokenizer.decode(run))
    if state:
        pieces.append(CLOSE)
    lines += ["".join(pieces), "", "--- tokens: index, id, trained, text ---"]
    lines += [f"{t:5d} {tid:7d} {m} {tokenizer.decode([tid])!r}"
              for t, (tid, m) in enumerate(zip(example.input_ids, example.mask))]
    return "\n".join(lines) + "\n\n"
