"""Loading one trainable model: weights, engine, replicas, trainer and checkpoints, as a `LoadedModel`.

A new model starts at a step-0 checkpoint of its fresh weights; one with checkpoints (a
restart) resumes at its latest complete one. Engine replicas and trainer ranks beyond the
first run in processes of their own, or on Ray (`art.ray_cluster`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time

import torch

from art.base_models import load_policy, reference_loader
from art.devices import cpu_split
from art.engine.adapters import AdapterSet
from art.engine.llm_engine import LLMEngine
from art.errors import ArtValueError
from art.service.api import ModelSpec
from art.service.engines import choose_engine, describe, engine_record, start_vllm
from art.service.loaded import LoadedModel
from art.service.settings import parse_internal_config
from art.storage import CheckpointStore, ModelDir
from art.training.trainer import Trainer

log = logging.getLogger(__name__)


def bound_malloc_growth() -> None:
    """Stop glibc from keeping freed tensor memory (RSS grew ~3 GB per step without this).

    glibc raises its mmap threshold after large frees, so later 1-32 MB tensors come from
    per-thread heaps that fragment; sampler, trainer and server threads then pile up freed
    memory. A fixed threshold (what MALLOC_MMAP_THRESHOLD_ does) returns it to the OS.
    """
    if sys.platform != "linux" or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
    except (OSError, AttributeError):
        pass


def _serves_while_training(settings, engine: LLMEngine) -> bool:
    """Whether training steps run beside the serving engine: as asked, or whenever it can."""
    if settings.serve_while_training is False or settings.fsdp:
        return False
    if engine.serves_while_training:
        return True
    if settings.serve_while_training:
        engine.stop()
        raise ArtValueError(
            "serve_while_training=True needs a model the engine decodes itself (the Llama family); "
            "this one is served through transformers' forward, which reads the trained weights: "
            "leave serve_while_training unset",
            field="serve_while_training",
        )
    return False


def load_model(root, spec: ModelSpec, placement: str = "processes", default_engine: str = "auto") -> LoadedModel:
    """`spec`'s model under the storage `root`. `placement`: where engine replicas and trainer
    ranks 1..N-1 run unless the model's internal config says: "processes" or "ray" (`art.ray_cluster`).
    `default_engine`: which engine serves it unless its internal config says ("auto", "ours", "vllm")."""
    bound_malloc_growth()
    name, project, base_model = spec.name, spec.project, spec.base_model
    internal = dict(spec.internal_config or {})
    settings = parse_internal_config(internal)  # ArtValueError naming the field, before any loading
    kind = choose_engine(settings.engine_kind or default_engine, settings.vllm_python)
    engine_config = settings.engine.resolve()
    directory = ModelDir(root, project, name)
    device, dtype = engine_config.device, engine_config.torch_dtype
    lora = settings.lora  # None under full fine-tuning
    on_ray = (settings.placement or placement) == "ray"
    torch.manual_seed(settings.seed)  # reproducible adapter init at step 0
    model, tokenizer = load_policy(base_model, lora, dtype=dtype, device=device, trainable=not settings.fsdp)
    lock = threading.RLock()
    if kind == "vllm":  # vLLM serves from a process of its own, started once a checkpoint exists
        adapters, serve_while_training = None, settings.serve_while_training is not False
    else:
        adapters = AdapterSet(model)
        engine = LLMEngine(model, tokenizer, engine_config, lock=lock, adapters=adapters)
        serve_while_training = _serves_while_training(settings, engine)
    # Beside a serving engine the trainer needs no lock of the engine's: the engine reads only
    # its own copies of the live weights (`art.engine.served_weights`).
    trainer_lock = threading.RLock() if serve_while_training else lock
    replicas = None
    if settings.engine_replicas > 1:  # replicas 1..N-1 build the same model in processes of their own
        from art.devices import process_threads
        from art.engine.replica_process import REPLICA_THREADS, ReplicaSpec
        from art.engine.replicas import ReplicaSet

        replica_class = None
        if on_ray:
            from art.ray_cluster import RayReplica as replica_class
        replica_spec = ReplicaSpec(base_model, lora, engine.config, process_threads(REPLICA_THREADS))
        replicas = ReplicaSet(
            engine, replica_spec, settings.engine_replicas, replica_class, dedicated=settings.dedicated_samplers
        )
    peers = None
    if settings.trainer_ranks > 1 or settings.fsdp:  # ranks 1..N-1 (sharded: all N) are processes of their own
        from art.training.ranks import RankPeers, RankSpec

        transport = None
        if on_ray:
            from art.ray_cluster import RayRanks as transport
        peers = RankPeers(
            settings.trainer_ranks,
            RankSpec(base_model, lora, str(device), str(dtype).removeprefix("torch."), settings.fsdp),
            transport,
        )
    if settings.fsdp:
        from art.training.ranks import ShardedTrainer

        trainer = ShardedTrainer(model, peers, lock=lock, device=device, dtype=dtype)
    else:
        trainer = Trainer(
            model,
            tokenizer,
            lock=trainer_lock,
            device=device,
            dtype=dtype,
            load_reference=reference_loader(base_model, lora, dtype=dtype, device=device),
        )
        if peers is not None:
            from art.training.ranks import LeadTrainer

            trainer = LeadTrainer(trainer, peers)
    store = CheckpointStore(directory.checkpoints)
    latest = store.latest_step()
    if latest is None:
        store.write(0, trainer.save)
        latest = 0
        if peers is not None:
            trainer.sync_peers(store.path(0))
    else:
        trainer.restore(store.path(latest))
    if kind == "vllm":
        engine = start_vllm(
            settings,
            base_model=base_model,
            name=name,
            model=model,
            tokenizer=tokenizer,
            device=str(device),
            lora=lora,
            step=latest,
            checkpoint=store.path(latest),
            log_path=directory.path / "vllm.log",
        )
    else:
        adapters.live_step = latest
    model_json = {
        "name": name,
        "project": project,
        "base_model": base_model,
        "config": spec.config,
        "internal_config": internal,
        "lora": lora,
        "engine": engine_record(engine),
        "updated_at": time.time(),
    }
    loaded = LoadedModel(
        name=name,
        project=project,
        base_model=base_model,
        dir=directory,
        full_finetune=settings.full_finetune,
        device=device,
        model=model,
        tokenizer=tokenizer,
        lock=lock,
        adapters=adapters,
        engine=engine,
        replicas=replicas,
        trainer=trainer,
        store=store,
        step=latest,
        model_json=model_json,
        serve_while_training=serve_while_training,
        thread_split=(
            cpu_split(str(device), settings.training_threads) if serve_while_training and kind == "ours" else None
        ),
    )
    if replicas is not None:
        replicas.restart(latest, loaded.live_weights())  # all start, on the weights of `latest`
    forked_from = (directory.read_model_json() or {}).get("forked_from")  # a fork made before registering
    if forked_from is not None:
        model_json["forked_from"] = forked_from
    directory.write_model_json(model_json)
    print(f"[art] {project}/{name}: {describe(engine)}", file=sys.stderr, flush=True)
    log.info("%s/%s ready at step %d", project, name, latest)
    return loaded
