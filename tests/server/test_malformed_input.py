"""Malformed input on every route of `art serve`, table-driven: each case gets a 4xx that names
the field, nothing on disk changes, and afterwards the model still serves and trains.

The app runs in process (httpx's ASGI transport) with a key, a tiny trainable model, and
`model_roots` confined to the model's folder (as `art serve` confines them by default).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from art.serve import create_serve_app
from art.service.local import LocalService

KEY = "malformed-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
MODEL = "/art/models/p/tiny"
HI = [{"role": "user", "content": "Say one word."}]


@dataclass
class Case:
    id: str
    method: str
    path: str
    body: Any = None
    """A JSON value, or bytes sent as they are."""
    status: int = 400
    field: str | None = None
    """The error's `param` (equal, or a prefix of it); None: not checked."""


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": HI, "max_tokens": 2, **fields}


def register(**fields) -> dict:
    return {"name": "other", "project": "p", "trainable": True, "base_model": "PLACEHOLDER", **fields}


CHAT_CASES = [
    Case("chat no model", "POST", CHAT, {"messages": HI}, 400, "model"),
    Case("chat model not a string", "POST", CHAT, chat(model=123), 400, "model"),
    Case("chat model lone surrogate", "POST", CHAT, chat(model="\ud800"), 404, "model"),
    Case("chat model superscript step", "POST", CHAT, chat(model="tiny@²"), 404, "model"),
    Case("chat model empty step", "POST", CHAT, chat(model="tiny@"), 404, "model"),
    Case("chat model 5000-digit step", "POST", CHAT, chat(model="tiny@" + "9" * 5000), 404, "model"),
    Case("chat model negative step", "POST", CHAT, chat(model="tiny@-1"), 404, "model"),
    Case("chat model missing step", "POST", CHAT, chat(model="tiny@999999999"), 404, "model"),
    Case("chat model 20k chars", "POST", CHAT, chat(model="m" * 20000), 404, "model"),
    Case("chat model unknown", "POST", CHAT, chat(model="nobody"), 404, "model"),
    Case("chat model null byte", "POST", CHAT, chat(model="tiny\x00"), 404, "model"),
    Case("chat no messages", "POST", CHAT, {"model": "tiny"}, 400, "messages"),
    Case("chat empty messages", "POST", CHAT, chat(messages=[]), 400, "messages"),
    Case("chat messages a string", "POST", CHAT, chat(messages="hi"), 400, "messages"),
    Case("chat message without role", "POST", CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0]"),
    Case("chat message unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
         "messages[0]"),
    Case("chat content a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0]"),
    Case("chat image part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages[0]"),
    Case("chat n zero", "POST", CHAT, chat(n=0), 400, "n"),
    Case("chat n negative", "POST", CHAT, chat(n=-3), 400, "n"),
    Case("chat n huge", "POST", CHAT, chat(n=10**6), 400, "n"),
    Case("chat n a float", "POST", CHAT, chat(n=1.5), 400, "n"),
    Case("chat temperature negative", "POST", CHAT, chat(temperature=-1), 400, "temperature"),
    Case("chat temperature huge", "POST", CHAT, chat(temperature=1e9), 400, "temperature"),
    Case("chat temperature a word", "POST", CHAT, chat(temperature="hot"), 400, "temperature"),
    Case("chat temperature infinite", "POST", CHAT, b'{"model": "tiny", "messages": [{"role": "user", '
         b'"content": "x"}], "temperature": Infinity}', 400, "temperature"),
    Case("chat top_p zero", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    Case("chat top_p above one", "POST", CHAT, chat(top_p=1.5), 400, "top_p"),
    Case("chat max_tokens zero", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    Case("chat max_tokens negative", "POST", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    Case("chat max_tokens past the context", "POST", CHAT, chat(max_tokens=10**12), 400, "messages"),
    Case("chat max_tokens a word", "POST", CHAT, chat(max_tokens="many"), 400, "max_tokens"),
    Case("chat max_completion_tokens negative", "POST", CHAT, chat(max_completion_tokens=-1), 400,
         "max_completion_tokens"),
    Case("chat stop a number", "POST", CHAT, chat(stop=5), 400, "stop"),
    Case("chat five stops", "POST", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    Case("chat seed a word", "POST", CHAT, chat(seed="x"), 400, "seed"),
    Case("chat logprobs a word", "POST", CHAT, chat(logprobs="sometimes"), 400, "logprobs"),
    Case("chat top_logprobs too many", "POST", CHAT, chat(logprobs=True, top_logprobs=100), 400, "top_logprobs"),
    Case("chat top_logprobs negative", "POST", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    Case("chat tools a string", "POST", CHAT, chat(tools="x"), 400, "tools"),
    Case("chat tool without function", "POST", CHAT, chat(tools=[{"type": "function"}]), 400, "tools"),
    Case("chat tool_choice without tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    Case("chat tool_choice unknown name", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    Case("chat stream a word", "POST", CHAT, chat(stream="sometimes"), 400, "stream"),
    Case("chat ignore_eos a word", "POST", CHAT, chat(ignore_eos="always"), 400, "ignore_eos"),
    Case("chat penalty", "POST", CHAT, chat(frequency_penalty=1.0), 400, "frequency_penalty"),
    Case("chat repetition penalty", "POST", CHAT, chat(repetition_penalty=1.2), 400, "repetition_penalty"),
    Case("chat top_k below -1", "POST", CHAT, chat(top_k=-2), 400, "top_k"),
    Case("chat min_p above 1", "POST", CHAT, chat(min_p=1.5), 400, "min_p"),
    Case("chat response_format unknown type", "POST", CHAT, chat(response_format={"type": "yaml"}), 400,
         "response_format.type"),
    Case("chat response_format a string", "POST", CHAT, chat(response_format="json"), 400, "response_format"),
    Case("chat json_schema missing", "POST", CHAT, chat(response_format={"type": "json_schema"}), 400,
         "response_format"),
    Case("chat json_schema invalid", "POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}), 400, "response_format"),
    Case("chat json_schema a list", "POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}), 400, "response_format"),
    Case("chat json_schema name too long", "POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "n" * 100, "schema": {}}}), 400, "response_format"),
    Case("chat tool parameters an impossible schema", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
        tool_choice="required"), 400, "tools"),
    Case("chat body not JSON", "POST", CHAT, b"{not json", 400),
    Case("chat body an array", "POST", CHAT, [1, 2], 400),
    Case("chat body empty", "POST", CHAT, b"", 400),
    Case("chat body a string", "POST", CHAT, "hello", 400),
    Case("chat prompt past the context", "POST", CHAT, chat(messages=[{"role": "user", "content": "word " * 3000}]),
         400, "messages"),
    Case("chat body over 8 MiB", "POST", CHAT, chat(messages=[{"role": "user", "content": "x" * (9 << 20)}]), 413),
    Case("chat unknown route", "POST", "/v1/chat/completion", chat(), 404),
    Case("models wrong method", "DELETE", "/v1/models", None, 405),
]

REGISTER_CASES = [
    Case("register no name", "POST", "/art/models", {"project": "p"}, 400, "name"),
    Case("register empty name", "POST", "/art/models", register(name=""), 400, "name"),
    Case("register name traversal", "POST", "/art/models", register(name=".."), 400, "name"),
    Case("register name with slash", "POST", "/art/models", register(name="a/b"), 400, "name"),
    Case("register name 200 chars", "POST", "/art/models", register(name="n" * 200), 400, "name"),
    Case("register name lone surrogate", "POST", "/art/models", register(name="\ud800"), 400, "name"),
    Case("register name a number", "POST", "/art/models", register(name=5), 400, "name"),
    Case("register project traversal", "POST", "/art/models", register(project="../etc"), 400, "project"),
    Case("register trainable without base_model", "POST", "/art/models", register(base_model=None), 400,
         "base_model"),
    Case("register base_model /etc/passwd", "POST", "/art/models", register(base_model="/etc/passwd"), 400,
         "base_model"),
    Case("register base_model missing path", "POST", "/art/models", register(base_model="/no/such/dir"), 400,
         "base_model"),
    Case("register base_model relative escape", "POST", "/art/models",
         register(base_model="../../../../etc/hosts"), 400, "base_model"),
    Case("register base_model home", "POST", "/art/models", register(base_model="~/.ssh"), 400, "base_model"),
    Case("register base_model a number", "POST", "/art/models", register(base_model=7), 400, "base_model"),
    Case("register base_model 10k chars", "POST", "/art/models", register(base_model="m" * 10_000), 400,
         "base_model"),
    Case("register base_model 300-char name", "POST", "/art/models", register(base_model="m" * 300), 400,
         "base_model"),  # longer than a file name may be: the path check must not fail on it
    Case("register base_model 300-char path", "POST", "/art/models", register(base_model="/" + "m" * 300), 400,
         "base_model"),
    Case("register base_model null byte", "POST", "/art/models", register(base_model="org/m\x00x"), 400,
         "base_model"),
    Case("register base_model path with a null byte", "POST", "/art/models", register(base_model="/m\x00x"), 400,
         "base_model"),
    Case("register base_model unknown user's home", "POST", "/art/models",
         register(base_model="~no-such-user-4242/m"), 400, "base_model"),
    Case("register internal_config a string", "POST", "/art/models", register(internal_config="x"), 400,
         "internal_config"),
    Case("register engine_args typo", "POST", "/art/models", register(
        internal_config={"engine_args": {"max_num_seq": 1}}), 400, "engine_args.max_num_seq"),
    Case("register gpu_memory_utilization 2", "POST", "/art/models", register(
        internal_config={"engine_args": {"gpu_memory_utilization": 2}}), 400, "engine_args.gpu_memory_utilization"),
    Case("register max_num_seqs zero", "POST", "/art/models", register(
        internal_config={"engine_args": {"max_num_seqs": 0}}), 400, "engine_args.max_num_seqs"),
    Case("register device tpu", "POST", "/art/models", register(
        internal_config={"engine_args": {"device": "tpu"}}), 400, "engine_args.device"),
    Case("register full_finetune a word", "POST", "/art/models", register(
        internal_config={"full_finetune": "yes"}), 400, "full_finetune"),
    Case("register full_finetune with peft_args", "POST", "/art/models", register(
        internal_config={"full_finetune": True, "peft_args": {"r": 4}}), 400, "peft_args"),
    Case("register seed a word", "POST", "/art/models", register(internal_config={"seed": "x"}), 400, "seed"),
    Case("register lora rank negative", "POST", "/art/models", register(
        internal_config={"peft_args": {"r": -1}}), 400, "internal_config"),
    Case("register unknown field", "POST", "/art/models", register(colour="red"), 400, "colour"),
    Case("register body not JSON", "POST", "/art/models", b"[", 400),
]

LOG = f"{MODEL}/log"
LOG_CASES = [
    Case("log step 10**300", "POST", LOG, {"split": "train", "step": 10**300}, 400, "step"),
    Case("log step negative", "POST", LOG, {"split": "train", "step": -1}, 400, "step"),
    Case("log step a word", "POST", LOG, {"split": "train", "step": "x"}, 400, "step"),
    Case("log step a float", "POST", LOG, {"split": "train", "step": 1.5}, 400, "step"),
    Case("log no split", "POST", LOG, {"step": 1}, 400, "split"),
    Case("log split traversal", "POST", LOG, {"split": "../x", "step": 1}, 400, "split"),
    Case("log split empty", "POST", LOG, {"split": "", "step": 1}, 400, "split"),
    Case("log metric named step", "POST", LOG, {"split": "val", "step": 1, "metrics": {"step": 7}}, 400,
         "metrics.step"),
    Case("log metric named split", "POST", LOG, {"split": "val", "step": 1, "metrics": {"split": 1}}, 400,
         "metrics.split"),
    Case("log metric named recorded_at", "POST", LOG, {"split": "val", "step": 1, "metrics": {"recorded_at": 1}},
         400, "metrics.recorded_at"),
    Case("log metric name 1000 chars", "POST", LOG, {"split": "val", "step": 1, "metrics": {"m" * 1000: 1}},
         400, "metrics"),
    Case("log metric value a dict", "POST", LOG, {"split": "val", "step": 1, "metrics": {"m": {"a": 1}}}, 400,
         "metrics.m"),
    Case("log groups a string", "POST", LOG, {"split": "val", "step": 1, "trajectory_groups": "x"}, 400,
         "trajectory_groups"),
    Case("log unknown field", "POST", LOG, {"split": "val", "step": 1, "extra": 1}, 400, "extra"),
    Case("log project with a slash", "POST", "/art/models/..%2Fx/tiny/log", {"split": "val", "step": 1}, 404),
    Case("log bad name", "POST", "/art/models/p/bad%20name/log", {"split": "val", "step": 1}, 400, "name"),
]

OTHER_CASES = [
    Case("step of a bad name", "GET", "/art/models/p/bad%20name/step", None, 400, "name"),
    Case("checkpoints of an unknown model", "GET", "/art/models/p/nobody/checkpoints", None, 404, "model"),
    Case("delete checkpoints of an unknown model", "DELETE", "/art/models/p/nobody/checkpoints", None, 404, "model"),
    Case("delete checkpoints bad project", "DELETE", "/art/models/.x/tiny/checkpoints", None, 400, "project"),
    Case("delete checkpoints metric empty", "DELETE", f"{MODEL}/checkpoints?best_checkpoint_metric=", None, 400,
         "best_checkpoint_metric"),
    Case("delete checkpoints metric 1000 chars", "DELETE", f"{MODEL}/checkpoints?best_checkpoint_metric={'m' * 1000}",
         None, 400, "best_checkpoint_metric"),
    Case("checkpoints of a bad name", "GET", "/art/models/p/bad%20name/checkpoints", None, 400, "name"),
    Case("cancel training of an unknown model", "DELETE", "/art/models/p/nobody/train", None, 404, "model"),
    Case("metrics of a bad name", "GET", "/art/models/p/x%00/metrics", None, 400, "name"),
    Case("fork base_model 300-char name", "POST", "/art/models/p/forked/fork",
         {"from_project": "p", "from_model": "tiny", "base_model": "m" * 300}, 400, "base_model"),
    Case("fork base_model 10k chars", "POST", "/art/models/p/forked/fork",
         {"from_project": "p", "from_model": "tiny", "base_model": "m" * 10_000}, 400, "base_model"),
]


def train_cases(good: dict) -> list[Case]:
    """Train bodies: a valid one (one group of 4 real samples) with one thing broken each."""
    path = f"{MODEL}/train"
    where = "trajectory_groups[0].trajectories[0].messages_and_choices[1]"

    def broken(change) -> dict:
        body = copy.deepcopy(good)
        change(body)
        return body

    def choice(body) -> dict:
        return body["trajectory_groups"][0]["trajectories"][0]["messages_and_choices"][1]

    def set_choice(key, value):
        return lambda body: choice(body).__setitem__(key, value)

    def set_option(key, value):
        return lambda body: body["options"].__setitem__(key, value)

    return [
        Case("train no groups", "POST", path, {}, 400, "trajectory_groups"),
        Case("train groups a string", "POST", path, {"trajectory_groups": "x"}, 400, "trajectory_groups"),
        Case("train reward a word", "POST", path, broken(
            lambda b: b["trajectory_groups"][0]["trajectories"][0].__setitem__("reward", "x")), 400,
            "trajectory_groups[0].trajectories[0].reward"),
        Case("train reward infinite", "POST", path, json.dumps(broken(
            lambda b: b["trajectory_groups"][0]["trajectories"][0].__setitem__("reward", float("inf")))).encode(),
            400, "trajectory_groups[0].trajectories[0].reward"),
        Case("train token id past the vocabulary", "POST", path, broken(set_choice("token_ids", [10**9])), 400,
             f"{where}.token_ids[0]"),
        Case("train token id negative", "POST", path, broken(set_choice("token_ids", [-1])), 400,
             f"{where}.token_ids[0]"),
        Case("train token ids words", "POST", path, broken(set_choice("token_ids", ["a", "b"])), 400,
             f"{where}.token_ids[0]"),
        Case("train token ids floats", "POST", path, broken(set_choice("token_ids", [1.5])), 400,
             f"{where}.token_ids[0]"),
        Case("train token ids a string", "POST", path, broken(set_choice("token_ids", "12")), 400,
             f"{where}.token_ids"),
        Case("train prompt id past the vocabulary", "POST", path, broken(
            lambda b: choice(b)["prompt_token_ids"].__setitem__(0, 10**7)), 400, f"{where}.prompt_token_ids[0]"),
        Case("train prompt id a bool", "POST", path, broken(
            lambda b: choice(b)["prompt_token_ids"].__setitem__(0, True)), 400, f"{where}.prompt_token_ids[0]"),
        Case("train logprobs shorter than tokens", "POST", path, broken(
            lambda b: choice(b)["logprobs"]["content"].pop()), 400, f"{where}.logprobs.content"),
        Case("train logprob positive", "POST", path, broken(
            lambda b: choice(b)["logprobs"]["content"][0].__setitem__("logprob", 5.0)), 400,
            f"{where}.logprobs.content[0].logprob"),
        Case("train logprob NaN", "POST", path, json.dumps(broken(
            lambda b: choice(b)["logprobs"]["content"][0].__setitem__("logprob", float("nan")))).encode(), 400,
            f"{where}.logprobs.content[0].logprob"),
        Case("train logprob a word", "POST", path, broken(
            lambda b: choice(b)["logprobs"]["content"][0].__setitem__("logprob", "low")), 400, where),
        Case("train sequence past the context", "POST", path, broken(
            lambda b: choice(b).__setitem__("prompt_token_ids", [5] * 2000)), 400, f"{where}.token_ids"),
        Case("train choice without message", "POST", path, broken(
            lambda b: choice(b).pop("message")), 400, "trajectory_groups[0]"),
        Case("train epochs 10**7", "POST", path, broken(set_option("epochs", 10**7)), 400, "options.epochs"),
        Case("train epochs zero", "POST", path, broken(set_option("epochs", 0)), 400, "options.epochs"),
        Case("train mini_batches a million", "POST", path, broken(set_option("mini_batches", 10**6)), 400,
             "options.mini_batches"),
        Case("train learning_rate 1e30", "POST", path, broken(set_option("learning_rate", 1e30)), 400,
             "options.learning_rate"),
        Case("train learning_rate negative", "POST", path, broken(set_option("learning_rate", -1.0)), 400,
             "options.learning_rate"),
        Case("train learning_rate a word", "POST", path, broken(set_option("learning_rate", "fast")), 400,
             "options.learning_rate"),
        Case("train micro_batch_tokens zero", "POST", path, broken(set_option("micro_batch_tokens", 0)), 400,
             "options.micro_batch_tokens"),
        Case("train packed_row_tokens 2**40", "POST", path, broken(set_option("packed_row_tokens", 2**40)), 400,
             "options.packed_row_tokens"),
        Case("train packing unknown", "POST", path, broken(set_option("packing", "zip")), 400, "options.packing"),
        Case("train beta negative", "POST", path, broken(set_option("beta", -1)), 400, "options.beta"),
        Case("train epsilon zero", "POST", path, broken(set_option("epsilon", 0)), 400, "options.epsilon"),
        Case("train max_grad_norm zero", "POST", path, broken(set_option("max_grad_norm", 0)), 400,
             "options.max_grad_norm"),
        Case("train scale_rewards unknown", "POST", path, broken(set_option("scale_rewards", "maybe")), 400,
             "options.scale_rewards"),
        Case("train advantage_balance 2", "POST", path, broken(set_option("advantage_balance", 2)), 400,
             "options.advantage_balance"),
        Case("train constant normalisation alone", "POST", path, broken(
            set_option("loss_normalization", "constant")), 400, "max_tokens_normalizer"),
        Case("train unknown option", "POST", path, broken(set_option("warp_speed", 9)), 400, "options.warp_speed"),
        Case("train dev_config unknown", "POST", path, broken(
            lambda b: b.__setitem__("dev_config", {"colour": 1})), 400, "dev_config.colour"),
        Case("train config learning_rate zero", "POST", path, broken(
            lambda b: b.__setitem__("config", {"learning_rate": 0})), 400, "config.learning_rate"),
        Case("train expected_step negative", "POST", path, broken(
            lambda b: b.__setitem__("expected_step", -1)), 400, "expected_step"),
        Case("train expected_step 10**300", "POST", path, broken(
            lambda b: b.__setitem__("expected_step", 10**300)), 400, "expected_step"),
        Case("train expected_step stale", "POST", path, broken(
            lambda b: b.__setitem__("expected_step", 41)), 409, "expected_step"),
        Case("train cancel_on_disconnect a word", "POST", path, broken(
            lambda b: b.__setitem__("cancel_on_disconnect", "sometimes")), 400, "cancel_on_disconnect"),
        Case("train unknown field", "POST", path, broken(lambda b: b.__setitem__("turbo", True)), 400, "turbo"),
        Case("train unknown model", "POST", "/art/models/p/nobody/train", good, 404, "model"),
        Case("train bad name", "POST", "/art/models/p/x%20y/train", good, 400, "name"),
    ]


def disk(root: Path) -> dict[str, str]:
    """Every file and folder under `root`, files with a hash of their content."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
async def server(tiny_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("malformed")
    local = LocalService(str(root))
    app = create_serve_app(local, api_key=KEY, watchdog_s=None, watchdog_train_s=None,
                           model_roots=[tiny_model_path.parent])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver", headers=AUTH,
                                 timeout=120) as http:
        response = await http.post("/art/models", json={"name": "tiny", "project": "p", "trainable": True,
                                                        "base_model": str(tiny_model_path)})
        assert response.status_code == 200, response.text
        yield http, root, tiny_model_path
    await local.close()


async def valid_train_body(http) -> dict:
    trajectories = []
    for rank in range(4):
        response = await http.post(CHAT, json=chat(max_tokens=3, seed=rank))
        assert response.status_code == 200, response.text
        trajectories.append({"messages_and_choices": [HI[0], response.json()["choices"][0]], "reward": float(rank)})
    return {"trajectory_groups": [{"trajectories": trajectories}], "options": {"learning_rate": 1e-2}}


async def send(http, case: Case, base_model: str) -> httpx.Response:
    body = case.body
    if isinstance(body, dict) and body.get("base_model") == "PLACEHOLDER":
        body = {**body, "base_model": base_model}
    if isinstance(body, bytes):
        return await http.request(case.method, case.path, content=body, headers={"content-type": "application/json"})
    if body is None:
        return await http.request(case.method, case.path)
    # ensure_ascii: a lone surrogate travels as its \\ud800 escape, as any client would send it
    return await http.request(case.method, case.path, content=json.dumps(body).encode(),
                              headers={"content-type": "application/json"})


async def test_every_malformed_request_is_a_4xx_naming_the_field_and_changes_nothing(server):
    http, root, tiny = server
    good = await valid_train_body(http)
    cases = CHAT_CASES + REGISTER_CASES + LOG_CASES + OTHER_CASES + train_cases(good)
    assert len(cases) >= 100
    before = disk(root)
    failures = []
    for case in cases:
        response = await send(http, case, str(tiny))
        error = response.json().get("error", {}) if response.headers.get("content-type", "").startswith(
            "application/json") else {}
        param = error.get("param") or ""
        problems = []
        if response.status_code != case.status:
            problems.append(f"status {response.status_code}, expected {case.status}")
        if case.field is not None and not (param == case.field or param.startswith(case.field)):
            problems.append(f"param {param!r}, expected {case.field!r}")
        if len(error.get("message", "")) > 2000:
            problems.append(f"a {len(error['message'])}-character message")
        if problems:
            failures.append(f"{case.id}: {'; '.join(problems)} -- {response.text[:300]}")
    assert not failures, "\n".join(failures)
    assert disk(root) == before  # nothing written, created or deleted

    # Still serving and training, and the valid body really was valid.
    response = await http.post(CHAT, json=chat())
    assert response.status_code == 200
    response = await http.post(f"{MODEL}/train", json=good)
    last = json.loads(response.text.strip().splitlines()[-1])
    assert response.status_code == 200 and last["type"] == "result" and last["step"] == 1, last


@pytest.mark.integration
async def test_the_event_loop_stays_responsive_while_a_5mb_prompt_is_refused(tiny_model_path, tmp_path):
    """Templating and tokenising 5 MB take seconds; they run off the event loop, so /health (and
    every other request) is answered meanwhile. Before, each /health waited for all of it."""
    import statistics
    import time

    from art.server.thread import ServerThread

    local = LocalService(str(tmp_path))
    with ServerThread(create_serve_app(local, watchdog_s=None, watchdog_train_s=None)) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
            response = await http.post("/art/models", json={"name": "tiny", "project": "p", "trainable": True,
                                                            "base_model": str(tiny_model_path)})
            assert response.status_code == 200
            big = chat(messages=[{"role": "user", "content": "word " * (1 << 20)}])  # 5 MiB of text
            refused = asyncio.create_task(http.post(CHAT, json=big))
            waits = []
            while not refused.done():
                start = time.perf_counter()
                assert (await http.get("/health")).status_code == 200
                waits.append(time.perf_counter() - start)
                await asyncio.sleep(0.02)
            response = await refused
    await local.close()
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert len(waits) >= 10  # the refusal took a while: /health was asked all along
    assert statistics.quantiles(waits, n=10)[-1] < 0.1 and max(waits) < 1.0, waits
