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
from collections.abc import Callable

import torch

from art.base_models import load_policy, reference_loader, support_problem
from art.devices import cpu_split
from art.engine.adapters import AdapterSet
from art.engine.base import ManagedEngine
from art.engine.llm_engine import LLMEngine
from art.errors import ArtValueError
from art.service.api import ModelSpec
from art.service.engines import choose_engine, describe, engine_record, start_vllm
from art.service.loaded import LoadedModel
from art.service.settings import parse_internal_config
from art.storage import CheckpointStore, ModelDir
from art.training.trainer import Trainer, TrainerHandle

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
    if base_model is None:  # `LocalService` refuses such a spec before it gets here
        raise ArtValueError(f"{project}/{name}: a trainable model needs a base_model", field="base_model")
    internal = dict(spec.internal_config or {})
    settings = parse_internal_config(internal)  # ArtValueError naming the field, before any loading
    kind = choose_engine(settings.engine_kind or default_engine, settings.vllm_python)
    engine_config = settings.engine.resolve()
    directory = ModelDir(root, project, name)
    device, dtype = engine_config.device, engine_config.torch_dtype
    lora = settings.lora  # None under full fine-tuning
    on_ray = (settings.placement or placement) == "ray"
    problem = support_problem(base_model)
    if problem is not None:
        raise ArtValueError(problem, field="base_model")
    torch.manual_seed(settings.seed)  # reproducible adapter init at step 0
    model, tokenizer = load_policy(base_model, lora, dtype=dtype, device=device, trainable=not settings.fsdp)
    lock = threading.RLock()
    ours, adapters, serve_while_training = _our_engine(kind, model, tokenizer, engine_config, lock, settings)
    # Beside a serving engine the trainer needs no lock of the engine's: the engine reads only
    # its own copies of the live weights (`art.engine.served_weights`).
    trainer_lock = threading.RLock() if serve_while_training else lock
    replicas = _replica_set(ours, settings, base_model, lora, on_ray)  # None with a single replica
    trainer = _trainer(model, tokenizer, settings, base_model, trainer_lock, lock, device, dtype, on_ray)
    store = CheckpointStore(directory.checkpoints)
    latest = _resume_or_start(store, trainer)
    engine: ManagedEngine
    if ours is None or adapters is None:  # vLLM: its server starts on the checkpoint of `latest`
        engine = _start_vllm(settings, base_model, name, model, tokenizer, device, latest, store, directory)
    else:
        engine = ours
        adapters.live_step = latest
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
        model_json=_model_record(spec, internal, lora, engine),
        serve_while_training=serve_while_training,
        thread_split=(
            cpu_split(str(device), settings.training_threads) if serve_while_training and kind == "ours" else None
        ),
    )
    if replicas is not None:
        replicas.restart(latest, loaded.live_weights())  # all start, on the weights of `latest`
    _announce_ready(loaded)
    return loaded


def _our_engine(
    kind: str, model, tokenizer, engine_config, lock: threading.RLock, settings
) -> tuple[LLMEngine | None, AdapterSet | None, bool]:
    """Our in-process engine and its adapters (None when vLLM serves), and whether training runs beside serving."""
    if kind == "vllm":  # vLLM serves from a process of its own, started once a checkpoint exists
        return None, None, settings.serve_while_training is not False
    adapters = AdapterSet(model)
    ours = LLMEngine(model, tokenizer, engine_config, lock=lock, adapters=adapters)
    return ours, adapters, _serves_while_training(settings, ours)


def _resume_or_start(store: CheckpointStore, trainer: TrainerHandle) -> int:
    """The step a model starts at: its latest complete checkpoint (a restart), or step 0 of fresh weights."""
    latest = store.latest_step()
    if latest is None:
        store.write(0, trainer.save)
        trainer.sync_peers(store.path(0))
        return 0
    trainer.restore(store.path(latest))
    return latest


def _start_vllm(
    settings,
    base_model: str,
    name: str,
    model,
    tokenizer,
    device,
    step: int,
    store: CheckpointStore,
    directory: ModelDir,
) -> ManagedEngine:
    """vLLM's server for the model, started on the checkpoint of `step`, logging beside the model's files."""
    return start_vllm(
        settings,
        base_model=base_model,
        name=name,
        model=model,
        tokenizer=tokenizer,
        device=str(device),
        lora=settings.lora,
        step=step,
        checkpoint=store.path(step),
        log_path=directory.path / "vllm.log",
    )


def _model_record(spec: ModelSpec, internal: dict, lora: dict | None, engine: ManagedEngine) -> dict:
    """What model.json says of the model: its spec, its LoRA settings and the engine serving it."""
    return {
        "name": spec.name,
        "project": spec.project,
        "base_model": spec.base_model,
        "config": spec.config,
        "internal_config": internal,
        "lora": lora,
        "engine": engine_record(engine),
        "updated_at": time.time(),
    }


def _announce_ready(loaded: LoadedModel) -> None:
    """Write the model's model.json, keeping a fork's `forked_from`, and say which engine serves it."""
    directory, model_json = loaded.dir, loaded.model_json
    forked_from = (directory.read_model_json() or {}).get("forked_from")  # a fork made before registering
    if forked_from is not None:
        model_json["forked_from"] = forked_from
    directory.write_model_json(model_json)
    print(f"[art] {loaded.project}/{loaded.name}: {describe(loaded.engine)}", file=sys.stderr, flush=True)
    log.info("%s/%s ready at step %d", loaded.project, loaded.name, loaded.step)


def _replica_set(ours: LLMEngine | None, settings, base_model: str, lora: dict | None, on_ray: bool):
    """Engine replicas 1..N-1 beside `ours` (replica 0), as local processes or Ray actors; None
    when `engine_replicas` asks for one. The replicas build the same model in processes of their own."""
    if settings.engine_replicas <= 1:
        return None
    from art.devices import process_threads
    from art.engine.replica_process import REPLICA_THREADS, CalledReplica, ReplicaSpec
    from art.engine.replicas import ReplicaSet

    if ours is None:
        raise ArtValueError(
            "engine_replicas is not available with engine='vllm' yet; use engine='ours' for it", field="engine_replicas"
        )
    replica_class: type[CalledReplica] | None = None
    if on_ray:
        from art.ray_cluster import RayReplica

        replica_class = RayReplica
    spec = ReplicaSpec(base_model, lora, ours.config, process_threads(REPLICA_THREADS))
    return ReplicaSet(ours, spec, settings.engine_replicas, replica_class, dedicated=settings.dedicated_samplers)


def _trainer(
    model, tokenizer, settings, base_model: str, lock, engine_lock, device, dtype: torch.dtype, on_ray: bool
) -> TrainerHandle:
    """The model's trainer: a lone `Trainer`, or the handle on its trainer ranks (ranks 1..N-1,
    sharded all N, are processes of their own: `art.training.rank_trainers`). `lock`: the trainer's;
    `engine_lock`: the engine's, which a sharded trainer takes to load each checkpoint it serves."""
    lora = settings.lora

    def local_trainer() -> Trainer:  # alone, or rank 0 of a group
        reference = reference_loader(base_model, lora, dtype=dtype, device=device)
        return Trainer(model, tokenizer, lock=lock, device=device, dtype=dtype, load_reference=reference)

    if settings.trainer_ranks == 1 and not settings.fsdp:
        return local_trainer()
    from art.training.rank_group import RankPeers, RankTransport
    from art.training.rank_trainers import LeadTrainer, ShardedTrainer
    from art.training.ranks import RankSpec

    transport: Callable[[int, RankSpec, int], RankTransport] | None = None
    if on_ray:
        from art.ray_cluster import RayRanks

        transport = RayRanks
    peers = RankPeers(
        settings.trainer_ranks,
        RankSpec(base_model, lora, str(device), str(dtype).removeprefix("torch."), settings.fsdp),
        transport,
    )
    if settings.fsdp:
        return ShardedTrainer(model, peers, lock=engine_lock, device=device, dtype=dtype)
    return LeadTrainer(local_trainer(), peers)
