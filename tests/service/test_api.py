"""The service API (`art.service`): one protocol that `LocalService` implements in process and
`RemoteService` over HTTP, one resolution of training options, one spec of a model."""

from __future__ import annotations

import inspect

import pytest

import art
from art.backends.adapter import ServiceAdapter
from art.backends.remote import RemoteService
from art.errors import ArtValueError, ModelNotFoundError
from art.service import ModelSpec, Service, resolve_train_options
from art.service.local import LocalService


def test_options_merge_in_order_and_a_bad_one_names_where_it_came_from():
    options = resolve_train_options(art.TrainConfig(learning_rate=1e-3, beta=0.1), {"beta": 0.2, "epsilon": 0.3},
                                    {"epsilon": 0.4})
    assert (options.learning_rate, options.beta, options.epsilon) == (1e-3, 0.2, 0.4)
    assert resolve_train_options().learning_rate == art.TrainConfig().learning_rate
    for args, field in [((None, None, {"beta": -1.0}), "options.beta"),
                        ((None, {"epsilon": -1.0}, {"beta": 0.5}), "dev_config.epsilon"),
                        ((None, {"nonsense": 1}, None), "dev_config.nonsense"),
                        (({"learning_rate": 2.0}, None, None), "config.learning_rate"),
                        ((art.TrainConfig(learning_rate=2.0), None, {"learning_rate": 3.0}), "options.learning_rate")]:
        with pytest.raises(ArtValueError) as info:
            resolve_train_options(*args)
        assert info.value.field == field, args


@pytest.mark.parametrize("implementation", [LocalService, RemoteService])
def test_both_services_implement_every_method_of_the_protocol(implementation):
    methods = [name for name, _ in inspect.getmembers(Service, inspect.isfunction) if not name.startswith("_")]
    assert {"register", "specs", "train", "log", "step", "checkpoints", "delete_checkpoints", "history"} <= set(methods)
    for name in methods:
        ours, protocol = getattr(implementation, name), getattr(Service, name)
        assert inspect.iscoroutinefunction(ours), name
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(protocol).parameters), name


@pytest.mark.integration
def test_both_backends_are_the_one_adapter():
    assert issubclass(art.LocalBackend, ServiceAdapter) and issubclass(art.RemoteBackend, ServiceAdapter)
    assert isinstance(art.LocalBackend(path="unused").service, LocalService)
    assert isinstance(art.RemoteBackend("http://127.0.0.1:9", api_key="k").service, RemoteService)


def test_a_spec_carries_what_the_server_needs():
    trainable = art.TrainableModel(name="m", project="p", base_model="base", config={"x": 1},
                                   _internal_config={"seed": 3})
    spec = ModelSpec.of(trainable)
    assert (spec.key, spec.trainable, spec.base_model, spec.config, spec.internal_config) == (
        ("p", "m"), True, "base", {"x": 1}, {"seed": 3})
    assert spec.inference_base_url is None  # a trainable model is served by the backend
    baseline = ModelSpec.of(art.Model(name="gpt", project="p", inference_base_url="http://x/v1",
                                      inference_model_name="gpt-4o"))
    assert (baseline.trainable, baseline.inference_base_url, baseline.inference_model_name) == (
        False, "http://x/v1", "gpt-4o")


async def test_the_local_service_answers_by_key_without_loading_anything(tmp_path):
    service = LocalService(tmp_path)
    baseline = ModelSpec(project="p", name="baseline", inference_base_url="http://x/v1")
    assert await service.register(baseline) == 0
    assert await service.specs() == [baseline]
    await service.log(("p", "baseline"), split="val", step=0, metrics={"val/reward": 0.5}, groups=[])
    await service.log(("p", "never-registered"), split="val", step=1, metrics={"val/reward": 0.25}, groups=[])
    assert [row["val/reward"] for row in await service.history(("p", "baseline"))] == [0.5]
    assert [row["step"] for row in await service.history(("p", "never-registered"))] == [1]
    with pytest.raises(ArtValueError) as info:
        await service.checkpoints(("p", "baseline"))
    assert info.value.field == "trainable"
    with pytest.raises(ModelNotFoundError):
        await service.checkpoints(("p", "nobody"))
    assert await service.step(("p", "nobody")) == 0
    with pytest.raises(ArtValueError) as info:
        await service.register(ModelSpec(project="p", name="t", trainable=True))
    assert info.value.field == "base_model"
    assert ("p", "t") not in {spec.key for spec in await service.specs()}
