"""`Model` and `TrainableModel` take ART's keywords, are generic as ART's are, and refuse the rest.

ART's own tests annotate and cast with `TrainableModel[Any, dict[str, Any]]` and its examples
with `art.TrainableModel[MyConfig]`; a keyword we do not know must fail loudly, since a
silently dropped option (a misspelt one, or one of ART's we lack) changes nothing and says so
nowhere.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

import art
from art.service.settings import parse_internal_config


class GameConfig(BaseModel):
    learning_rate: float = 1e-5
    groups_per_step: int = 2


def test_models_are_generic_over_config_and_state_as_arts_are():
    def train(model: art.TrainableModel[GameConfig]) -> float:  # ART's examples annotate so
        return model.config.learning_rate

    # Subscripted at runtime, as ART's tests do inside typing.cast.
    typed = art.TrainableModel[Any, dict[str, Any]](name="a", project="p", base_model="b")
    assert isinstance(typed, art.TrainableModel) and isinstance(typed, art.Model)
    assert typed.trainable and typed.get_inference_name() == "a"

    # The config parameter validates: a dict becomes the config class, a wrong value is refused.
    model = art.TrainableModel[GameConfig](name="a", project="p", base_model="b", config={"learning_rate": 3e-5})
    assert isinstance(model.config, GameConfig) and train(model) == 3e-5
    with pytest.raises(ValueError, match="learning_rate"):
        art.Model[GameConfig](name="a", project="p", config={"learning_rate": "fast"})
    # Unsubscripted, config is any object, as before.
    marker = object()
    assert art.Model(name="a", project="p", config=marker).config is marker
    assert art.Model[GameConfig, dict].__name__ == "Model[GameConfig, dict]"


@pytest.mark.parametrize("cls,kwargs,unknown", [
    (art.Model, {"run_name": "a"}, "run_name"),  # ART's TrainableModel field, not Model's
    (art.Model, {"inference_base_ur": "http://x/v1"}, "inference_base_ur"),  # a typo
    (art.TrainableModel, {"base_model": "b", "lora_rank": 8}, "lora_rank"),
    (art.TrainableModel, {"base_model": "b", "zeta": 1, "alpha": 2}, "zeta"),
])
def test_an_unknown_keyword_is_an_error_naming_it(cls, kwargs, unknown):
    with pytest.raises(art.ArtValueError) as error:
        cls(name="a", project="p", **kwargs)
    assert error.value.field == unknown
    for name in kwargs:
        if name != "base_model":
            assert repr(name) in str(error.value)
    assert "inference_base_url" in str(error.value)  # it lists what the class does take


def test_a_field_declared_by_a_subclass_passes_the_check():
    """The check is pydantic's extra="forbid": a field declared anywhere in the class is known."""

    class WithNotes(art.TrainableModel):
        notes: str = ""

    assert WithNotes(name="a", project="p", base_model="b", notes="x").notes == "x"
    with pytest.raises(art.ArtValueError, match="'note'"):
        WithNotes(name="a", project="p", base_model="b", note="x")


def test_run_name_defaults_to_the_name_and_may_differ_from_it():
    assert art.TrainableModel(name="agent-001", project="p", base_model="b").run_name == "agent-001"
    model = art.TrainableModel(name="agent-001", run_name="agent-001", project="p", base_model="b")
    assert model.run_name == "agent-001"  # ART's docs pass both, equal
    other = art.TrainableModel(name="agent-001", run_name="agent-002", project="p", base_model="b")
    assert (other.run_name, other.get_inference_name()) == ("agent-002", "agent-001")  # served under the name
    with pytest.raises(art.ArtValueError) as bad:
        art.TrainableModel(name="bad/name", project="p", base_model="b")
    assert bad.value.field == "name"  # our own checks keep their error and field


def test_lora_config_reaches_the_adapter_settings():
    model = art.TrainableModel(name="a", project="p", base_model="b", run_id="run-7",
                               lora_config={"rank": 4, "alpha": 32})
    assert model.run_id == "run-7"
    lora = parse_internal_config(model._internal_config).lora  # what LocalBackend builds the adapter from
    assert (lora["r"], lora["lora_alpha"]) == (4, 32)
    same = art.TrainableModel(name="a", project="p", base_model="b", lora_config={"rank": 4},
                              _internal_config={"lora_config": {"rank": 4}, "seed": 3})
    assert same._internal_config == {"lora_config": {"rank": 4}, "seed": 3}
    with pytest.raises(art.ArtValueError) as clash:
        art.TrainableModel(name="a", project="p", base_model="b", lora_config={"rank": 4},
                           _internal_config={"lora_config": {"rank": 8}})
    assert clash.value.field == "lora_config"


def test_backend_accessor_names_the_missing_register():
    model = art.Model(name="a", project="p")
    with pytest.raises(art.ArtValueError, match="register"):
        model.backend()
