"""The context manager of the agent loop: what the model sees (RAGEN's ctx_manager).

It builds each episode's chat from the prompts (`stages.agent.prompts`) and keeps the episode's
token ids as the model consumed and produced them (token-in/token-out), which PPO trains on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envs import TextGameEnv
from stages.agent import prompts
from stages.agent.backends.base import Completion
from stages.agent.episode import Episode, Segment
from stages.common.config import RolloutConfig
from stages.common.errors import UserError

# Stands in for an assistant message when the chat template is rendered to find what it puts
# between the end of an assistant message and the next generation prompt.
_SENTINEL = "SPA-SENTINEL-7c1e0f"


@dataclass
class _Context:
    """The pieces of one episode's chat (see `prompts.build_messages`)."""

    prefix: str
    max_words: int  # the prompt's "Max response length" figure
    blocks: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)


class ContextManager:
    """Builds each episode's chat and keeps its token ids, token-in/token-out.

    The first prompt is the chat template's rendering of [system, user] with the generation prompt,
    then "<think>". Later prompts are not re-rendered: they are the previous prompt ids, plus the
    sampled completion ids, plus the ids of the text the template puts between the end of an
    assistant message and the next generation prompt (its end-of-turn marker, the next user message,
    the generation prompt) and "<think>". That text comes from rendering the chat with a sentinel as
    the assistant message and taking what follows it, which works for any template without knowing
    its special tokens (RAGEN looks them up by model name). So the model's own tokens are never
    re-tokenized; a re-tokenization can split text differently from the sampler.

    With `history_window` the prompt is the windowed chat, rendered afresh each turn.
    """

    def __init__(self, rollout: RolloutConfig, tokenizer: Any | None, prompt_mode: str):
        self.prompt_mode = prompt_mode
        self.tokenizer = tokenizer
        self.window = rollout.history_window
        self.contexts: dict[str, _Context] = {}

    # -- messages --

    def start(self, episode: Episode, env: TextGameEnv, state: str, budget: int) -> None:
        """Open the chat of a new episode: system prompt and the first user message."""
        context = _Context(prompts.instruction_prefix(env, self.prompt_mode, budget), prompts.word_limit(env))
        self.contexts[episode.id] = context
        context.blocks.append(self.next_block(episode, 1, state, budget))
        episode.single_sequence = self.window is None
        episode.messages = self._messages(context)
        if self.tokenizer is not None and episode.single_sequence:
            episode.token_ids = self._encode(self._render(episode.messages) + prompts.GENERATION_PREFIX)
            episode.response_mask = [0] * len(episode.token_ids)
            episode.logprobs = [0.0] * len(episode.token_ids)

    def _messages(self, context: _Context, window: int | None = None) -> list[dict[str, str]]:
        return prompts.build_messages(context.prefix, context.blocks, context.responses, context.rewards,
                                      window)

    def prompt_ids(self, episode: Episode) -> list[int]:
        if self.tokenizer is None:
            return []
        if episode.single_sequence:
            return list(episode.token_ids)
        messages = self._messages(self.contexts[episode.id], self.window)
        return self._encode(self._render(messages) + prompts.GENERATION_PREFIX)

    def record(self, episode: Episode, response: str, completion: Completion, prompt_ids: list[int],
               reward: float, next_block: str | None) -> None:
        """Add a finished turn: its response, reward and, unless the episode ended, the next block."""
        context = self.contexts[episode.id]
        before = self._messages(context)  # the chat up to the user message this turn answered
        context.responses.append(response)
        context.rewards.append(reward)
        if next_block is not None:
            context.blocks.append(next_block)
        episode.messages = self._messages(context)
        if self.tokenizer is not None:
            self._record_tokens(episode, completion, prompt_ids, before, next_block, reward)

    def next_block(self, episode: Episode, turn: int, state: str, actions_left: int) -> str:
        """The user text of turn `turn` (1-based): the state and the format reminder."""
        max_words = self.contexts[episode.id].max_words
        return prompts.turn_block(turn, state, actions_left, self.prompt_mode, max_words)

    def finish(self, episode: Episode) -> None:
        self.contexts.pop(episode.id, None)

    # -- tokens --

    def _record_tokens(self, episode: Episode, completion: Completion, prompt_ids: list[int],
                       before: list[dict[str, str]], next_block: str | None, reward: float) -> None:
        completion_ids = list(completion.token_ids) or self._encode(completion.text)
        sampled_logprobs = completion.logprobs if completion.token_ids else None
        if not episode.single_sequence:
            episode.segments.append(Segment(prompt_ids, completion_ids, sampled_logprobs))
            return
        start = len(episode.token_ids)
        episode.token_ids += completion_ids
        episode.response_mask += [1] * len(completion_ids)
        episode.turn_spans.append((start, len(episode.token_ids)))
        if sampled_logprobs is None or len(sampled_logprobs) != len(completion_ids):
            episode.logprobs = None
        elif episode.logprobs is not None:
            episode.logprobs += list(sampled_logprobs)
        if next_block is None:
            return
        user = prompts.reward_message(reward) + next_block
        delta = self._encode(self._between_turns(before, user, completion_ids))
        episode.token_ids += delta
        episode.response_mask += [0] * len(delta)
        if episode.logprobs is not None:
            episode.logprobs += [0.0] * len(delta)

    def _between_turns(self, before: list[dict[str, str]], user: str, completion_ids: list[int]) -> str:
        """The template's text after an assistant message up to the next "<think>" prefix."""
        chat = [*before, {"role": "assistant", "content": _SENTINEL}, {"role": "user", "content": user}]
        rendered = self._render(chat)
        if _SENTINEL not in rendered:
            raise UserError("this model's chat template does not render past assistant messages as written, "
                            "so prompts cannot be extended token by token; set rollout.history_window "
                            "(e.g. --set rollout.history_window=5) to re-render the prompt each turn")
        text = rendered[rendered.index(_SENTINEL) + len(_SENTINEL):] + prompts.GENERATION_PREFIX
        # A completion that stopped on the end-of-turn token already holds the template's marker.
        last = completion_ids[-1] if completion_ids else None
        if last is not None and last in self.tokenizer.all_special_ids:
            marker = self.tokenizer.decode([last])
            if marker and text.startswith(marker):
                text = text[len(marker):]
        return text

    def _render(self, messages: list[dict[str, str]]) -> str:
        # tokenize=False: newer transformers return a BatchEncoding, not ids, when tokenizing here.
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def visible_text(completion: Completion, tokenizer: Any | None) -> str:
    """The completion text without a trailing end-of-turn token's text, if the backend decoded it.

    The chat template adds that marker itself when the message is rendered again.
    """
    text, ids = completion.text, completion.token_ids
    if tokenizer is not None and ids and ids[-1] in tokenizer.all_special_ids:
        marker = tokenizer.decode([ids[-1]])
        if marker and text.endswith(marker):
            text = text[: -len(marker)]
    return text
