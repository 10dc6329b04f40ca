"""Helpers shared by the tests (not part of spa)."""


def tiny_model(tokenizer, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4):
    """A randomly initialised Llama with the given tokenizer's vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


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
