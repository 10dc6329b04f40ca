"""The one interface every generation backend follows.

The agent loop hands a backend a batch of requests, one per live episode, and gets back one
completion each. Requests carry token ids (token-in) and completions return the sampled token ids
(token-out), so PPO trains on exactly the tokens that were sampled. A request's `key` names its
episode: a backend may keep state per key (the HF backend keeps the episode's KV cache, since each
turn's prompt extends the previous turn's prompt and completion), but the result must not depend
on it.

An *n-request* serves several episodes that start from the same prompt (the samples of one
puzzle on their first turn): its `keys` name them, and the backend returns one completion per
key, in order, the i-th drawn as a lone request with seed ``seed + i`` would be (vLLM seeds the
i-th sample of ``SamplingParams(n=...)`` so). A backend that has no use for it plays the
request's `singles()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from envs import TextGameEnv


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 400
    temperature: float = 1.0
    top_p: float = 1.0
    # Generation stops right after any of these strings is produced (or at EOS / end of turn).
    stop: tuple[str, ...] = ("</answer>",)
    # The seed of a call's draws, for a backend that samples its batch together (hf).
    seed: int = 0


@dataclass
class GenerationRequest:
    key: str  # episode id
    prompt_ids: list[int]  # the whole context, ending with the generation prefix "<think>"
    env: TextGameEnv | None = None  # only the random backend looks at it
    # The seed of this request's own draws, for a backend that samples each request apart (vllm):
    # its tokens then do not depend on the other requests of the call.
    seed: int = 0
    # An n-request's further episodes, after `key`'s (see the module docstring).
    more_keys: tuple[str, ...] = ()
    # The episode's last allowed turn: it ends after this completion whatever it says, so a backend
    # keeps no state for it (the hf backend keeps no KV).
    last_turn: bool = False

    @property
    def keys(self) -> tuple[str, ...]:
        """The episodes this request samples for, one completion each."""
        return (self.key, *self.more_keys)

    def singles(self) -> list[GenerationRequest]:
        """The request as one request per key, the i-th seeded ``seed + i``: the same draws."""
        return [dataclasses.replace(self, key=key, seed=self.seed + i, more_keys=())
                for i, key in enumerate(self.keys)]


def all_singles(requests: list[GenerationRequest]) -> list[GenerationRequest]:
    """Every request of a call as one request per episode, in order (`GenerationRequest.singles`)."""
    return [single for request in requests for single in request.singles()]


@dataclass
class Completion:
    token_ids: list[int]  # sampled tokens, up to and including the stop string or EOS
    text: str  # decoded token_ids (the random backend has text only)
    logprobs: list[float] | None = None  # log-prob of each sampled token under the sampler
    finish_reason: str = "stop"  # "stop" (stop string), "eos", or "length"


#: `progress(tokens, completions)`: since the last report, `tokens` more sampled and `completions`
#: more finished. Over one `generate` call the reports add up to its tokens and its completions.
OnProgress = Callable[[int, int], None]


class GenerationBackend(Protocol):
    name: str
    #: The tokenizer of token-level backends (their prompts and completions are token ids); None for
    #: a text-only backend (random), whose episodes then keep no token ids.
    tokenizer: Any

    def generate(self, requests: list[GenerationRequest], params: SamplingParams,
                 progress: OnProgress | None = None) -> list[Completion]:
        """One completion per key of each request, in order; `progress` is told of tokens and
        completions as they are made (a backend that cannot tell earlier reports them all when it
        returns)."""
        ...

    def release(self, keys: list[str]) -> None:
        """Forget per-episode state for these keys (the episodes are done)."""
        ...

    def close(self) -> None:
        """Free what the backend holds (caches, an engine); it is not used afterwards."""
        ...


#: Chat end-of-turn markers of common model families; the ones in the vocabulary stop generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def end_token_ids(model, tokenizer) -> frozenset[int]:
    """The token ids that end a completion: the tokenizer's EOS, the model's generation config's,
    and the end-of-turn markers of common chat templates that are in the vocabulary."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos:
        ids.update(config_eos)
    for token in END_OF_TURN_TOKENS:  # in the vocabulary when the id maps back to the token
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token:
            ids.add(token_id)
    return frozenset(ids)
