"""EngineConfig and `_internal_config` as ART scripts write them: vLLM's and ART's names are
accepted, the meaningful ones honoured, the rest named once in a warning, typos refused."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

import art
from art.engine import config as engine_config
from art.engine.config import EngineConfig
from art.errors import ArtValueError
from art.service.settings import parse_internal_config

# What ART's own development scripts pass (art/dev engine args, Unsloth init args, trainer args).
ART_SCRIPT_CONFIG = {
    "init_args": {"max_seq_length": 96, "gpu_memory_utilization": 0.7, "load_in_4bit": True,
                  "fast_inference": True, "max_lora_rank": 8, "use_async": True},
    "engine_args": {"enforce_eager": True, "enable_sleep_mode": True, "max_lora_rank": 8,
                    "disable_log_requests": True, "num_scheduler_steps": 16, "max_num_seqs": 8},
    "trainer_args": {"gradient_accumulation_steps": 2},
    "_decouple_vllm_and_unsloth": True,
}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(engine_config, "_warned", set())


def test_vllm_names_are_honoured_or_named_once_and_typos_refused(caplog):
    caplog.set_level(logging.WARNING, logger="art.engine.config")
    args = {"max_num_seqs": 12, "max_model_len": 256, "gpu_memory_utilization": 0.6, "enforce_eager": True,
            "max_num_batched_tokens": 1024, "max_loras": 2, "enable_prefix_caching": False,
            "enable_sleep_mode": True, "max_lora_rank": 16, "seed": 3}
    config = EngineConfig.from_engine_args(args)
    assert (config.max_num_seqs, config.max_model_len, config.gpu_memory_utilization, config.enforce_eager) == \
        (12, 256, 0.6, True)
    assert (config.prefill_tokens, config.max_loaded_adapters, config.prefix_cache_tokens) == (1024, 2, 0)
    assert config.ignored == ("enable_sleep_mode", "max_lora_rank", "seed")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and all(k in warnings[0] for k in config.ignored)
    EngineConfig.from_engine_args(args)  # the same keys again: no second warning
    assert len(caplog.records) == 1

    with pytest.raises(ArtValueError) as info:
        EngineConfig.from_engine_args({"max_num_seq": 8})  # a typo vLLM would refuse too
    assert info.value.field == "engine_args.max_num_seq" and "max_num_seqs" in str(info.value)


@pytest.mark.parametrize(("args", "field"), [
    ({"gpu_memory_utilization": 1.5}, "engine_args.gpu_memory_utilization"),
    ({"gpu_memory_utilization": "0.5"}, "engine_args.gpu_memory_utilization"),
    ({"dtype": "int3"}, "engine_args.dtype"),
    ({"device": "tpu"}, "engine_args.device"),
    ({"enforce_eager": "yes"}, "engine_args.enforce_eager"),
    ({"max_model_len": 0}, "engine_args.max_model_len"),
    ({"merge_lora": 1.0}, "engine_args.merge_lora"),
])
def test_bad_values_name_the_field(args, field):
    with pytest.raises(ArtValueError) as info:
        EngineConfig.from_engine_args(args)
    assert info.value.field == field


def test_auto_resolves_to_the_machine():
    resolved = EngineConfig().resolve()
    if torch.cuda.is_available():
        assert resolved.device.startswith("cuda") and resolved.dtype == "bfloat16"
    else:
        assert (resolved.device, resolved.dtype) == ("cpu", "float32")
        with pytest.raises(ArtValueError) as info:
            EngineConfig(device="cuda").resolve()
        assert info.value.field == "engine_args.device" and "no CUDA" in str(info.value)
    assert EngineConfig(dtype="bf16").resolve().torch_dtype == torch.bfloat16


def test_max_num_seqs_defaults_by_device_and_a_given_one_is_kept():
    """A CPU engine decodes up to 256 rows at once: a burst of rollouts (ART's yes_no_maybe
    sends 288) runs in one wide batch, where 64-row waves took about 1.35x as long."""
    assert EngineConfig().max_num_seqs is None
    assert EngineConfig(device="cpu").resolve().max_num_seqs == engine_config.CPU_MAX_NUM_SEQS == 256
    assert EngineConfig(device="cpu", max_num_seqs=8).resolve().max_num_seqs == 8
    if torch.cuda.is_available():
        assert EngineConfig(device="cuda").resolve().max_num_seqs == engine_config.CUDA_MAX_NUM_SEQS == 64
    with pytest.raises(ArtValueError) as info:
        EngineConfig.from_engine_args({"max_num_seqs": 0})
    assert info.value.field == "engine_args.max_num_seqs"


async def test_a_cpu_engine_admits_a_burst_past_64_rows_in_one_step(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from art.engine.base import SamplingParams
    from art.engine.llm_engine import LLMEngine

    engine = LLMEngine(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                       AutoTokenizer.from_pretrained(tiny_model_path), device="cpu")
    try:
        with engine.paused():  # the burst arrives whole before the first step admits it
            requests = [asyncio.ensure_future(engine.generate([1, 2, 3 + i], SamplingParams(max_tokens=4), None))
                        for i in range(100)]
            await asyncio.sleep(0.05)
        peak = 0
        while not all(r.done() for r in requests):
            peak = max(peak, engine.running)
            await asyncio.sleep(0.001)
        await asyncio.gather(*requests)
        assert engine.scheduler.max_num_seqs == 256 and peak == 100
    finally:
        engine.stop()


def test_art_internal_config_keys(caplog):
    caplog.set_level(logging.WARNING, logger="art.engine.config")
    settings = parse_internal_config({**ART_SCRIPT_CONFIG, "lora_config": {"rank": 4, "alpha": 32, "dropout": 0.0}})
    assert settings.engine.max_model_len == 96  # init_args.max_seq_length
    assert settings.engine.gpu_memory_utilization == 0.7 and settings.engine.max_num_seqs == 8
    assert (settings.lora["r"], settings.lora["lora_alpha"]) == (4, 32)  # ART's newer lora_config names
    text = " ".join(r.getMessage() for r in caplog.records)
    for ignored in ("trainer_args", "_decouple_vllm_and_unsloth", "load_in_4bit", "fast_inference",
                    "enable_sleep_mode", "num_scheduler_steps"):
        assert ignored in text
    assert parse_internal_config({"init_args": {"full_finetuning": True}}).full_finetune
    with pytest.raises(ArtValueError) as info:
        parse_internal_config({"full_finetune": True, "lora_config": {"rank": 4}})
    assert info.value.field == "lora_config"


def test_scale_out_keys_are_checked():
    settings = parse_internal_config({"trainer_ranks": 2, "engine_replicas": 3, "placement": "ray"})
    assert (settings.trainer_ranks, settings.engine_replicas, settings.placement) == (2, 3, "ray")
    assert parse_internal_config({}).placement is None  # the backend's default decides
    for bad, field in [({"trainer_ranks": 0}, "trainer_ranks"), ({"engine_replicas": True}, "engine_replicas"),
                       ({"engine_replicas": 65}, "engine_replicas"), ({"placement": "moon"}, "placement")]:
        with pytest.raises(ArtValueError) as info:
            parse_internal_config(bad)
        assert info.value.field == field


@pytest.mark.integration
async def test_an_art_script_config_registers_and_serves(tiny_model_path, tmp_path):
    """ART's development-script `_internal_config` died at register with a TypeError before."""
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_path),
                               _internal_config=ART_SCRIPT_CONFIG)
    await model.register(backend)
    engine = backend.service.loaded(("p", "m")).engine
    assert engine.max_model_len == 96 and engine.scheduler.max_num_seqs == 8
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert len(completion.choices[0].token_ids) <= 3
    await backend.close()


def test_the_engine_is_chosen_by_name_and_checked():
    """`engine` names the engine ("auto" is the default); with vLLM, engine_args are vLLM's and
    are not checked against ours here, and what vLLM cannot do yet is refused naming the field."""
    from art.service.engines import choose_engine

    assert parse_internal_config({}).engine_kind is None
    vllm = parse_internal_config({"engine": "vllm", "vllm_python": "/opt/v/bin/python",
                                  "engine_args": {"tensor_parallel_size": 2, "enable_sleep_mode": True}})
    assert (vllm.engine_kind, vllm.vllm_python) == ("vllm", "/opt/v/bin/python")
    assert vllm.engine_args == {"tensor_parallel_size": 2, "enable_sleep_mode": True}
    assert vllm.engine.dtype == "auto"  # the trainer's: by device, or the dtype vLLM is given
    bf16 = parse_internal_config({"engine": "vllm", "engine_args": {"dtype": "bfloat16"}})
    assert bf16.engine.dtype == "bfloat16"
    with pytest.raises(ArtValueError) as info:  # ours still refuses what neither engine knows
        parse_internal_config({"engine": "ours", "engine_args": {"max_num_seqz": 2}})
    assert info.value.field == "engine_args.max_num_seqz"
    for bad, field in [({"engine": "sglang"}, "engine"), ({"engine": "vllm", "engine_replicas": 2}, "engine_replicas"),
                       ({"engine": "vllm", "trainer_ranks": 2}, "trainer_ranks"), ({"vllm_python": 3}, "vllm_python")]:
        with pytest.raises(ArtValueError) as info:
            parse_internal_config(bad)
        assert info.value.field == field
    assert choose_engine("ours") == "ours" and choose_engine("vllm") == "vllm"
    if not torch.cuda.is_available():  # auto: vLLM only on CUDA, even with vLLM named
        assert choose_engine("auto", "/opt/v/bin/python") == "ours" and choose_engine(None) == "ours"


def test_vllm_args_are_the_users_over_what_the_backend_needs(caplog):
    from art.service.engines import vllm_args

    known = frozenset({"max_model_len", "dtype", "logprobs_mode", "enforce_eager", "max_lora_rank", "max_loras", "enable_sleep_mode", "model",
                       "kv_cache_memory_bytes", "generation_config", "structured_outputs_config", "tokenizer"})

    def args(engine_args, **kwargs):
        settings = parse_internal_config({"engine": "vllm", "engine_args": engine_args})
        options = dict(device="cpu", lora_rank=4, served_name="base", checkpoint=None, engine_args=known,
                       version="0.32.0") | kwargs
        return vllm_args(settings, "/models/base", **options)

    built = args({"max_model_len": 1024, "dtype": "bfloat16", "model": "elsewhere"})
    assert built["model"] == "/models/base" and built["served_model_name"] == "base"  # ours, with a warning
    assert "ignoring engine_args model" in caplog.text
    assert (built["max_model_len"], built["dtype"]) == (1024, "bfloat16")  # the user's win
    assert (built["enable_lora"], built["max_lora_rank"], built["max_loras"]) == (True, 8, 2)  # rank 4 -> 8
    assert built["generation_config"] == "vllm" and built["structured_outputs_config"] == {"backend": "guidance"}
    assert built["kv_cache_memory_bytes"] == 2 << 30 and built["enable_scale_out"] is True
    on_gpu = args({}, device="cuda:0", lora_rank=None, checkpoint=Path("/runs/0003"))
    assert on_gpu["model"] == "/runs/0003" and on_gpu["tokenizer"] == "/models/base"  # full fine-tuning
    assert on_gpu["enforce_eager"] is True and "enforce_eager" not in built  # no compile per restart
    assert "enable_lora" not in on_gpu and "dtype" not in on_gpu and "kv_cache_memory_bytes" not in on_gpu
    assert built["logprobs_mode"] == "raw_logprobs"
    with pytest.raises(ArtValueError, match="vLLM 0.32.0 has no such engine argument") as info:
        args({"max_num_seqz": 4})
    assert info.value.field == "engine_args.max_num_seqz"
    with pytest.raises(ArtValueError) as info:  # the trainer's logprobs are the raw distribution's
        args({"logprobs_mode": "processed_logprobs"})
    assert info.value.field == "engine_args.logprobs_mode"
