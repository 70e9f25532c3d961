"""`LocalService`: the service API (`art.service`) over models loaded in this process.

It holds one `LoadedModel` (weights, engine, trainer, checkpoints) per trainable model, the
specs of every registered model, and the storage root. `LocalBackend` adapts it for
`art.Model`; `art serve` puts it behind the management and OpenAI routes. It is also what the
OpenAI routes resolve a request's `model` with (`served_model_names`, `resolve`).

After a restart (even `kill -9`) nothing is registered, but the runs are on disk: naming a
model with a `model.json` under the root registers it again from that file (`spec`), at its
latest complete checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from art.engine.base import ServedModel
from art.errors import ArtValueError, BackendError, ModelNotFoundError
from art.naming import echo, model_part
from art.service.api import ModelKey, ModelSpec, Progress, TrainResult
from art.service.watchdog import Activity
from art.storage.history import read_history
from art.storage.layout import ModelDir, stored_runs, validate_name
from art.storage.run_log import write_log
from art.training.options import TrainOptions
from art.training.sft_options import SFTOptions

if TYPE_CHECKING:
    from art.service.loaded import LoadedModel

log = logging.getLogger(__name__)


class LocalService:
    def __init__(self, root: str | Path, *, placement: str = "processes", engine: str = "auto") -> None:
        """`placement`: where models' engine replicas and trainer ranks 1..N-1 run unless their
        internal config says: "processes" or "ray" (`art.ray_cluster`). `engine`: which engine
        serves models whose internal config names none ("auto", "ours", "vllm": `art.service.engines`)."""
        self.root = Path(root)
        self.placement = placement
        self.engine = engine
        self._specs: dict[ModelKey, ModelSpec] = {}
        self._loaded: dict[ModelKey, LoadedModel] = {}  # imported lazily (torch)
        self._locks: dict[ModelKey, asyncio.Lock] = {}

    # -- registration ---------------------------------------------------------------------
    async def register(self, spec: ModelSpec) -> int:
        async with self._locks.setdefault(spec.key, asyncio.Lock()):  # one load per model
            return await self._register(spec)

    async def _register(self, spec: ModelSpec) -> int:
        if spec.trainable and spec.key not in self._loaded:
            if not spec.base_model:
                raise ArtValueError(
                    f"{spec.project}/{spec.name}: a trainable model needs a base_model", field="base_model"
                )
            from art.service.build import load_model  # heavy: torch, transformers

            try:
                self._loaded[spec.key] = await asyncio.to_thread(
                    load_model, self.root, spec, self.placement, self.engine
                )
            except ArtValueError:
                raise
            except OSError as exc:  # mostly transformers' "no such model": name what was asked for
                raise ArtValueError(
                    f"registering {spec.project}/{spec.name} failed; check base_model "
                    f"{echo(spec.base_model)}: {echo(str(exc))}",
                    field="base_model",
                ) from exc
            except (TypeError, ValueError) as exc:  # what peft, the engine or torch refused in it
                raise ArtValueError(
                    f"registering {spec.project}/{spec.name} failed; check internal_config "
                    f"{echo(spec.internal_config)}: {echo(str(exc))}",
                    field="internal_config",
                ) from exc
        self._specs[spec.key] = spec
        return self._loaded[spec.key].step if spec.key in self._loaded else 0

    async def specs(self) -> list[ModelSpec]:
        """The models registered so far (recovered ones included)."""
        return list(self._specs.values())

    async def spec(self, key: ModelKey) -> ModelSpec | None:
        """The registered model, or its stored run registered again from its model.json (a
        restart); None when there is neither."""
        if key in self._specs:
            return self._specs[key]
        async with self._locks.setdefault(key, asyncio.Lock()):
            if key in self._specs:
                return self._specs[key]
            stored = await asyncio.to_thread(ModelDir(self.root, *key).read_model_json)
            if not stored or not isinstance(stored.get("base_model"), str):
                return None
            internal = stored.get("internal_config")
            spec = ModelSpec(
                project=key[0],
                name=key[1],
                trainable=True,
                base_model=stored["base_model"],
                config=stored.get("config"),
                internal_config=internal if isinstance(internal, dict) else None,
            )
            log.warning("%s/%s was not registered in this process: loading it from its stored run (a restart?)", *key)
            try:
                await self._register(spec)
            except Exception as exc:
                raise BackendError(
                    f"{key[0]}/{key[1]} is stored under {self.root} but could not be loaded again "
                    f"({type(exc).__name__}: {exc}); register it again"
                ) from exc
            return spec

    async def recover_served(self, requested: str) -> bool:
        """For the OpenAI routes: `name` or `name@step` of a stored run not loaded yet; True
        when it was loaded. A name stored under several projects is not guessed."""
        name = model_part(requested)
        try:
            validate_name(name, "model")
        except ArtValueError:
            return False
        keys = [
            key for key in await asyncio.to_thread(stored_runs, self.root) if key[1] == name and key not in self._specs
        ]
        if len(keys) > 1:
            raise ModelNotFoundError(
                f"The model {echo(requested)} is not loaded, and runs named {echo(name)} are stored in several "
                f"projects ({', '.join(p for p, _ in keys)}): register the one you mean with "
                "`await model.register(backend)`"
            )
        return bool(keys) and await self.spec(keys[0]) is not None

    def loaded(self, key: ModelKey) -> LoadedModel:
        """The `LoadedModel` of a registered trainable model (for tools and tests that look inside)."""
        loaded = self._loaded.get(key)
        if loaded is None:
            raise ModelNotFoundError(f"model {key[0]}/{key[1]} is not registered with this backend")
        return loaded

    async def _trainable(self, key: ModelKey) -> LoadedModel:
        spec = await self.spec(key)
        if spec is None:
            raise ModelNotFoundError(
                f"model {key[0]}/{key[1]} is not registered and no run of it is stored under "
                f"{self.root}: call `await model.register(backend)`"
            )
        if not spec.trainable:
            raise ArtValueError(f"model {key[0]}/{key[1]} was registered as not trainable", field="trainable")
        return self._loaded[key]

    # -- the service API ------------------------------------------------------------------
    async def step(self, key: ModelKey) -> int:
        await self.spec(key)  # a stored run reports its step after a restart
        loaded = self._loaded.get(key)
        return loaded.step if loaded is not None else 0

    async def train(
        self,
        key: ModelKey,
        groups: list,
        options: TrainOptions,
        *,
        expected_step: int | None = None,
        progress: Progress | None = None,
    ) -> TrainResult:
        from art.service.update import run_update

        loaded = await self._trainable(key)
        groups = list(groups)
        loaded.check_groups(groups)  # a 400 naming the trajectory before anything moves
        return await run_update(
            loaded, groups, loaded.trainer.step, options, expected_step=expected_step, progress=progress
        )

    async def train_sft(
        self,
        key: ModelKey,
        trajectories: list,
        options: SFTOptions,
        *,
        expected_step: int | None = None,
        progress: Progress | None = None,
    ) -> TrainResult:
        """Supervised fine-tuning (`art.training.sft`) in the same transaction as `train`: one
        call, one optimizer step per batch, one checkpoint (the step counter advances by one,
        as in ART), then the weight-sync probe. The trajectories are rendered first, so bad
        input is refused before anything moves; with nothing left to train (no trajectories, or
        all longer than the context) the model stays at its step, as in ART."""
        from art.service.update import run_update

        loaded = await self._trainable(key)
        plan = await asyncio.to_thread(loaded.prepare_sft, list(trajectories), options)
        if not plan.batches:
            return TrainResult(loaded.step, plan.counts())
        return await run_update(loaded, plan, loaded.fit_sft, options, expected_step=expected_step, progress=progress)

    async def check_training_input(self, key: ModelKey, groups: list) -> None:
        loaded = await self._trainable(key)
        await asyncio.to_thread(loaded.check_groups, list(groups))

    async def cancel_training(self, key: ModelKey) -> bool:
        return (await self._trainable(key)).cancel()

    async def log(
        self, key: ModelKey, *, split: str, step: int, metrics: dict, groups: list, scenario_ids: Iterable[str] = ()
    ) -> dict:
        """Any model's logs, registered or not (a prompted baseline only logs)."""
        return await asyncio.to_thread(
            write_log,
            ModelDir(self.root, *key),
            split=split,
            step=step,
            metrics=metrics,
            groups=groups,
            scenario_ids=scenario_ids,
        )

    async def checkpoints(self, key: ModelKey) -> list[int]:
        return await asyncio.to_thread((await self._trainable(key)).store.steps)

    async def delete_checkpoints(
        self, key: ModelKey, best_checkpoint_metric: str, keep_steps: list[int] | None = None
    ) -> list[int]:
        loaded = await self._trainable(key)
        if keep_steps is not None:
            return await asyncio.to_thread(loaded.delete_checkpoints, set(keep_steps))
        best = best_step(read_history(loaded.dir.history), best_checkpoint_metric)
        if best is None:
            log.warning("no %r in history: keeping only the latest checkpoint", best_checkpoint_metric)
        keep = {loaded.step} | ({best} if best is not None else set())
        return await asyncio.to_thread(loaded.delete_checkpoints, keep)

    async def history(self, key: ModelKey) -> list[dict]:
        return await asyncio.to_thread(read_history, ModelDir(self.root, *key).history)

    async def restart_replicas(self, key: ModelKey) -> list[int]:
        return await (await self._trainable(key)).restart_replicas()

    async def fork_checkpoint(self, spec: ModelSpec, source: ModelKey, *, not_after_step: int | None = None) -> int:
        """The source run must be stored under this service's root. A registered model loads
        and serves the forked step at once (`art.service.update.load_fork`); one not loaded here gets
        the checkpoint on disk and loads it when it registers."""
        from art.service.settings import parse_internal_config
        from art.storage.fork import plan_fork

        if not spec.trainable or not spec.base_model:
            raise ArtValueError(
                f"{spec.project}/{spec.name}: only a trainable model (with a base_model) can start from a checkpoint",
                field="model",
            )
        source = validate_name(source[0], "from_project"), validate_name(source[1], "from_model")
        async with self._locks.setdefault(spec.key, asyncio.Lock()):  # not while it registers
            loaded = self._loaded.get(spec.key)
            if loaded is not None:
                base_model, lora = loaded.base_model, (loaded.dir.read_model_json() or {}).get("lora", "unknown")
            else:
                base_model = spec.base_model
                try:
                    lora = parse_internal_config(spec.internal_config).lora
                except ArtValueError:
                    raise
                except (TypeError, ValueError) as exc:  # a mis-shaped value the parser did not name
                    raise ArtValueError(
                        f"check internal_config {echo(spec.internal_config)}: {echo(str(exc))}", field="internal_config"
                    ) from exc
            plan = await asyncio.to_thread(
                plan_fork, self.root, source, spec.key, base_model=base_model, lora=lora, not_after_step=not_after_step
            )
            if loaded is not None:
                from art.service.update import load_fork

                return await load_fork(loaded, plan)
            return await asyncio.to_thread(_fork_on_disk, ModelDir(self.root, *spec.key), spec, plan)

    async def close(self) -> None:
        """Stop every model's engine; the service cannot be reused."""
        for loaded in self._loaded.values():
            await asyncio.to_thread(loaded.close)
        self._loaded.clear()
        self._specs.clear()

    # -- what the OpenAI routes and the watchdog read --------------------------------------
    def served_model_names(self) -> list[str]:
        names: list[str] = []
        for loaded in self._loaded.values():
            names += loaded.served_names()
            if loaded.base_model not in names and not loaded.full_finetune:
                names.append(loaded.base_model)
        return names

    def resolve(self, model: str) -> ServedModel:
        specific = None  # a model that knows the name says why it cannot serve it
        for loaded in self._loaded.values():
            try:
                return loaded.resolve(model)
            except ModelNotFoundError as exc:
                if model_part(model) in (loaded.name, loaded.base_model):
                    specific = specific or exc
        if specific is not None:
            raise specific
        raise ModelNotFoundError(f"The model {echo(model)} does not exist; served: {self.served_model_names()}")

    def stats(self) -> dict[str, dict]:
        """Engine load per model, shown by GET /health."""
        return {f"{project}/{name}": loaded.stats() for (project, name), loaded in self._loaded.items()}

    def activities(self) -> list[Activity]:
        """What a watchdog (`art.service.watchdog`) checks: each model's engine loop (seconds
        without progress while it has work) and its running training step (seconds running)."""
        now, out = time.monotonic(), []
        for (project, name), loaded in list(self._loaded.items()):
            engine = loaded.engine
            out.append(Activity("engine", f"{project}/{name}", engine.stalled_s(), engine.thread_id))
            since, thread = loaded.training_since, loaded.training_thread
            if since is not None:
                out.append(Activity("training step", f"{project}/{name}", now - since, thread))
        return out


def best_step(history: list[dict], metric: str) -> int | None:
    """The step whose rows have the highest mean of `metric` (None when it was never logged)."""
    values: dict[int, list[float]] = {}
    for row in history:
        value, step = row.get(metric), row.get("step")
        if isinstance(value, (int, float)) and math.isfinite(value) and type(step) is int:
            values.setdefault(step, []).append(float(value))
    if not values:
        return None
    return max(values, key=lambda s: sum(values[s]) / len(values[s]))


def _fork_on_disk(dest: ModelDir, spec: ModelSpec, plan) -> int:
    """A fork into a model not loaded here: the checkpoint and a model.json that registers it
    (`LocalService.spec` after a restart, or `register`); B's untrained step 0 goes last."""
    from art.storage.checkpoints import CheckpointStore
    from art.storage.fork import copy_checkpoint, drop_other_steps

    store = CheckpointStore(dest.checkpoints)
    if plan.done_already:
        latest = store.latest_step()
        if latest is None:  # `plan_fork` found the forked step among its checkpoints
            raise BackendError(f"the checkpoints of {dest.path} disappeared while forking into it")
        return latest
    copy_checkpoint(plan, store)
    stored = dest.read_model_json() or {
        "name": spec.name,
        "project": spec.project,
        "base_model": spec.base_model,
        "config": spec.config,
        "internal_config": spec.internal_config or {},
    }
    try:
        dest.write_model_json({**stored, "forked_from": plan.record, "updated_at": time.time()})
    except BaseException:
        if plan.step != 0:
            store.delete(plan.step)  # leave B as it was
        raise
    drop_other_steps(store, plan.step)
    return plan.step
