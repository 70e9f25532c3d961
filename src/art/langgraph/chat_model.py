"""`init_chat_model`: the chat model a LangGraph agent calls, pointed at the ART model it trains.

It is a plain LangChain `ChatOpenAI` (so `bind_tools`, `with_structured_output`, streaming and
LangGraph's agents behave as LangChain documents them), not a wrapper: what trains is recorded
from its HTTP traffic by `wrap_rollout`'s capture, not by the chat model.
"""

from __future__ import annotations

from typing import Any

from art.errors import ArtValueError
from art.model import Model

from .context import rollout_model, served_names

try:
    from langchain_openai import ChatOpenAI
except ImportError as exc:  # an optional dependency: say which
    raise ImportError(
        "art.langgraph needs langchain-openai (and langgraph for the agents): pip install langchain-openai langgraph"
    ) from exc

# CPU sampling of a long answer can take minutes: `Model.openai_client()`'s limit. A number, not a
# Timeout object: LangChain caches its default clients by timeout (a Timeout is unhashable), and
# openai 3's httpx2 refuses an `httpx.Timeout`.
_TIMEOUT = 1800.0
# Settings of the HTTP client itself: given any, LangChain builds the async client from them too.
_CLIENT_KEYS = {
    "base_url",
    "openai_api_base",
    "api_key",
    "openai_api_key",
    "http_async_client",
    "async_client",
    "root_async_client",
    "openai_proxy",
    "timeout",
    "request_timeout",
    "max_retries",
    "default_headers",
    "default_query",
}


def init_chat_model(
    model: str | Model | None = None,
    *,
    model_provider: str | None = None,
    configurable_fields: None = None,
    config_prefix: str | None = None,
    **kwargs: Any,
) -> ChatOpenAI:
    """A `ChatOpenAI` for the ART model being trained (ART's signature).

    Inside `wrap_rollout(model, fn)` it talks to that model whatever string `model` is (as in
    ART, where `init_chat_model(model.name)` is the usual call); a string naming that model at a
    step (`"name@3"`) is sent as given. Elsewhere pass the ART model itself. Its base URL, API key
    and inference name are the model's, `temperature` is 1.0 (ART's: trained samples should be
    the policy's own) and the Chat Completions API is used; `kwargs` (`max_tokens`, `seed`,
    `temperature`, ...) are `ChatOpenAI` fields and win over these. `model_provider`,
    `configurable_fields` and `config_prefix` are accepted for ART's signature and ignored, as
    ART ignores them.
    """
    del model_provider, configurable_fields, config_prefix
    art_model = model if isinstance(model, Model) else rollout_model()
    if art_model is None:
        raise ArtValueError(
            "init_chat_model() does not know which ART model to talk to: call it inside a rollout run by "
            "art.langgraph.wrap_rollout(model, fn), or pass the model itself: init_chat_model(model)",
            field="model",
        )
    client = art_model.openai_client()  # raises, naming the model, before `register`
    settings: dict[str, Any] = {
        "model": _request_name(art_model, model),
        "base_url": art_model.inference_base_url,
        "api_key": art_model.inference_api_key or "none",
        "temperature": 1.0,
        "use_responses_api": False,  # our servers speak Chat Completions, and that is what capture reads
        "timeout": _TIMEOUT,
    }
    if not _CLIENT_KEYS & kwargs.keys():
        # The model's own async client: its backend's transport, tracing headers and cost hook.
        # A sync `invoke` gets a client of LangChain's to the same URL.
        settings.update(root_async_client=client, async_client=client.chat.completions)
    return ChatOpenAI(**{**settings, **kwargs})


def _request_name(art_model: Model, asked: str | Model | None) -> str:
    """`asked` when it names `art_model` (at some step), else the model's inference name."""
    if isinstance(asked, str) and asked.rsplit("@", 1)[0] in served_names(art_model):
        return asked
    return art_model.get_inference_name()
