"""The conversation SPA shows the agent, built from the game (SPA's released
`config/envs.yaml` and ctx_manager).

Layout of one episode's chat::

    system     "You're a helpful assistant. "
    user       instruction [+ legend] [+ actions] + turn block 1
    assistant  "<think>" + completion 1
    user       "Reward:\\n{r1}\\n" + turn block 2
    assistant  "<think>" + completion 2
    ...

Every text below is SPA's, character for character (trailing spaces included): the fine-tuned
model learns exactly this format, so a changed space is a changed task. The game supplies its
instruction, legend and action names; a game without a legend or action names (Sudoku) simply
leaves that part out.
"""

from __future__ import annotations

from envs import TextGameEnv

SYSTEM_PROMPT = "You're a helpful assistant. "

#: The response format requested in every turn block, per prompt mode.
FORMAT_PROMPTS = {
    "world_model": (
        "<think> <observation> [current state] </observation> [Your thoughts] "
        "<prediction> [next state]</prediction> </think> <answer> [your answer] </answer>"
    ),
    "base": "<think> [Your thoughts] </think> <answer> [your answer] </answer>",
}

#: Appended after the chat template's generation prompt so the model starts by thinking; the parser
#: puts it back in front of the completion.
GENERATION_PREFIX = "<think>"

ACTION_SEPARATOR = "||"

#: "Max response length: N words (tokens)." SPA's yaml sets max_tokens: 100 for all three games.
#: It is only prompt text; the real generation limit is rollout.max_new_tokens. A game may set a
#: `prompt_word_limit` attribute to change it.
DEFAULT_WORD_LIMIT = 100


def word_limit(env: TextGameEnv) -> int:
    return int(getattr(env, "prompt_word_limit", DEFAULT_WORD_LIMIT))


def instruction_prefix(env: TextGameEnv, prompt_mode: str, max_actions_per_traj: int) -> str:
    """The part of the first user message before "Turn 1": instruction, legend, action list."""
    text = env.instruction(prompt_mode)
    if env.legend:
        text += "\nThe meaning of each symbol in the state is:\n"
        text += ", ".join(f"{symbol}: {meaning}" for symbol, meaning in env.legend.items())
    if env.action_names:
        text += "\nYour available actions are:\n" + ", ".join(env.action_names)
        text += (
            f"\nYou can make up to {max_actions_per_traj} actions, "
            f'separated by the action separator " {ACTION_SEPARATOR} "\n'
        )
    return text


def turn_block(turn: int, state: str, actions_left: int, prompt_mode: str, max_words: int) -> str:
    """What each turn adds to a user message: the state and the format reminder (turn is 1-based)."""
    return (
        f"\nTurn {turn}:\nState:\n{state}\nYou have {actions_left} actions left. "
        f"Always output: {FORMAT_PROMPTS[prompt_mode]} with no extra text. Strictly follow this format. "
        f"Max response length: {max_words} words (tokens).\n"
    )


def as_base_prompt(messages: list[dict], env: TextGameEnv) -> list[dict] | None:
    """A world-model chat shown with the base prompt instead: the game's base instruction in the
    first user message and the base format in every turn block; the assistant turns unchanged.
    None when the chat does not start with this game's world-model instruction (another room
    size, another game)."""
    before, after = env.instruction("world_model"), env.instruction("base")
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None or not messages[first_user]["content"].startswith(before):
        return None
    rewritten = []
    for i, message in enumerate(messages):
        content = message["content"]
        if message["role"] == "user":
            if i == first_user:
                content = after + content[len(before):]
            content = content.replace(FORMAT_PROMPTS["world_model"], FORMAT_PROMPTS["base"])
        rewritten.append({**message, "content": content})
    return rewritten


def reward_message(reward: float) -> str:
    """Start of the user message after a turn; Python's str() of the float sum, as SPA prints it."""
    return f"Reward:\n{reward}\n"


def build_messages(prefix: str, blocks: list[str], responses: list[str], rewards: list[float],
                   window: int | None = None) -> list[dict[str, str]]:
    """The chat from its parts: `blocks[k]` is turn k+1's block, `responses[k]` the assistant text
    that answered it and `rewards[k]` its reward (`blocks` has one more entry than `responses` while
    the episode waits for the model's next turn).

    With `window`, only the last `window` answered turns are kept before the current one (RAGEN's
    history window); the instruction prefix always stays, joined to the first kept turn's block.
    """
    first = 0 if window is None else max(0, len(responses) - window)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": prefix + blocks[first]},
    ]
    for k in range(first, len(responses)):
        messages.append({"role": "assistant", "content": responses[k]})
        if k + 1 < len(blocks):
            messages.append({"role": "user", "content": reward_message(rewards[k]) + blocks[k + 1]})
    return messages
