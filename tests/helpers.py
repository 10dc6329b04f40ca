"""Helpers shared by the tests (not part of spa)."""


def tiny_model(tokenizer, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int | None = None):
    """A randomly initialised Llama with the given tokenizer's vocabulary (`kv_heads` key/value
    heads, `heads` by default)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def small_llama(vocab: int = 97, seed: int = 0):
    """A 2-layer random Llama with a small vocabulary of its own (no tokenizer): short sums, so
    tolerances derived from them stay tight."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def model_dir(model, tokenizer, path):
    """`model` with `tokenizer` saved as a Hugging Face directory at `path` (returned)."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def lively_model(tokenizer, seed: int = 0, **size):
    """`tiny_model` (of `size`: layers, hidden, heads) with larger weights: its greedy text depends
    on the context (the default init repeats one token), so cache or position mistakes change the
    output."""
    import torch

    model = tiny_model(tokenizer, seed=seed, **size)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2, generator=generator)
    return model.eval()


def _no_states_game():
    import random
    from typing import ClassVar

    from envs import TextGameEnv

    class NoStatesGame(TextGameEnv):
        """A game with no world-model prompt and no coordinates: say Stop. There is no state for the
        agent to write, so no VAGEN reward, and only the base prompt on the plain text."""

        name: ClassVar[str] = "no_states"
        action_names: ClassVar[tuple[str, ...]] = ("Stop",)
        metadata: ClassVar[dict] = {"render_modes": ["text"]}
        prompt_modes: ClassVar[tuple[str, ...]] = ("base",)
        instructions: ClassVar[dict[str, str]] = {"base": "Say Stop."}
        max_actions_per_traj: ClassVar[int] = 1

        def __init__(self, render_mode: str = "text"):
            super().__init__(render_mode=render_mode)
            self.stopped = False

        def _reset(self, rng: random.Random) -> None:
            self.stopped = False

        def _step(self, action: str) -> tuple[float, bool, bool, dict]:
            self.stopped = self.parse_action(action) is not None
            info = {"success": self.stopped, "action_is_valid": self.stopped, "action_is_effective": self.stopped}
            return float(self.stopped), self.stopped, False, info

        def render_grid(self) -> str:
            return "stopped" if self.stopped else "waiting"

        def coordinate_line(self) -> str:
            return ""

    return NoStatesGame


NoStatesGame = _no_states_game()


def answering_model(tokenizer, steps: int = 60, seed: int = 0):
    """A tiny random Llama taught, in a few seconds, to continue "<think>" with a short thought and
    an answer, ``Left`` or ``Jump`` about equally often (and, this briefly taught, now and then
    something malformed): FrozenLake episodes played by it earn different scores (a legal move 0,
    a malformed turn or unknown action the format penalty), so groups differ in reward spread."""
    import torch

    model = tiny_model(tokenizer, seed=seed)
    think = tokenizer.encode("<think>", add_special_tokens=False)
    answers = [tokenizer.encode(f" go </think> <answer> {move} </answer>", add_special_tokens=False)
               for move in ("Left", "Jump")]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        rows = []
        for answer in answers * 4:  # random contexts of 20-300 tokens, then "<think>" and the answer
            length = int(torch.randint(20, 300, (1,), generator=generator))
            rows.append((torch.randint(0, len(tokenizer), (length,), generator=generator).tolist() + think, answer))
        width = max(len(context) + len(answer) for context, answer in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        targets = torch.full((len(rows), width), -100)
        for i, (context, answer) in enumerate(rows):  # left-padded; the loss on the answer only
            tokens = context + answer
            ids[i, width - len(tokens):] = torch.tensor(tokens)
            mask[i, width - len(tokens):] = 1
            targets[i, width - len(answer):] = torch.tensor(answer)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        trained = targets[:, 1:] != -100  # the LM head only where a token is trained
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[trained]), targets[:, 1:][trained])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG file's header, which must be one."""
    import struct
    from pathlib import Path

    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def live_modules(collect: bool = True) -> int:
    """How many torch modules are still alive (after a full garbage collection, unless `collect` is
    off: then modules only reference cycles hold count too)."""
    import gc

    import torch

    if collect:
        gc.collect()
    return sum(issubclass(type(obj), torch.nn.Module) for obj in gc.get_objects())  # type(): no proxies


def aggregate_by_definition(mode: str, losses: list, budget: int):
    """verl's aggregation `mode` of a batch whose sequences have the token `losses` (1-D tensors),
    as its definition reads (stages/training/loss_agg.py), all at once; `budget` is
    seq-mean-token-sum-norm's constant."""
    import torch

    if mode == "token-mean":
        return torch.cat(losses).mean()
    per_sequence = {"seq-mean-token-mean": lambda loss: loss.mean(), "seq-mean-token-sum": lambda loss: loss.sum(),
                    "seq-mean-token-sum-norm": lambda loss: loss.sum() / budget}[mode]
    return torch.stack([per_sequence(loss) for loss in losses]).mean()


def assert_same_weights(after: dict, expected: dict, before: dict, tolerance: float) -> None:
    """The update `after - before` equals `expected - before` up to `tolerance` of its norm. Adam
    divides each gradient element by its own running magnitude, so one element whose gradient is
    rounding noise moves by up to a whole step either way; the update as a whole moves as its
    gradient does."""
    difference = sum(float((after[key].double() - expected[key].double()).square().sum()) for key in expected)
    update = sum(float((expected[key].double() - before[key].double()).square().sum()) for key in expected)
    assert update > 0 and difference <= tolerance**2 * update, (difference**0.5 / update**0.5, tolerance)


class FakeClock:
    """A clock for monkeypatching `time.monotonic` / `time.perf_counter`: it reads `now`, which the test moves."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
