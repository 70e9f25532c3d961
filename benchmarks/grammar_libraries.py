"""Grammar-constrained decoding libraries on the CPU: the per-token cost of the next-token mask.

    pip install --no-deps --target /tmp/gramlibs xgrammar apache-tvm-ffi outlines-core   # llguidance is a dependency
    PYTHONPATH=/tmp/gramlibs python benchmarks/grammar_libraries.py [--batch 32] [--repeats 5] [--threads N] [--decode]

(--no-deps keeps xgrammar from pulling triton and another torch; its CPU masks need neither.)

For llguidance, xgrammar and outlines-core (each one that imports; one that does not is skipped
with the reason), on the default model's tokenizer with masks as wide as its logits
(`config.vocab_size`) and two JSON schemas (a RULER-judge-like `scores` list and a small enum):
  setup     per-tokenizer work, once per process (llguidance LLTokenizer, xgrammar TokenizerInfo,
            outlines-core Vocabulary), ms
  compile   the schema to a grammar (llguidance: grammar_from_json_schema + validate_grammar + the
            first LLMatcher; xgrammar: GrammarCompiler.compile_json_schema; outlines-core: the regex
            and its Index over the vocabulary), ms
  matchers  `batch` matchers from the compiled grammar (llguidance: deep_copy of the first), ms
  mask      then a fixed valid JSON document, tokenized by the HF tokenizer and ended with EOS, is
            walked token by token: at each position the int32 next-token bitmask [batch, vocab/32]
            is filled for all rows (the library's batch API, "batch", or one row at a time,
            "loop"), checked to allow the document's token in every row, and all rows consume that
            token. Median, p90 and mean microseconds per batch mask step, the median per row, and the
            median microseconds to consume one token in all rows. The mean matters too: a mask
            inside a free string (most tokens allowed) can cost far more than the median step.
            All rows walk the same document, so they are in the same state at each step.
            outlines-core's Guide.advance refuses EOS (its mask allows it): there EOS is checked
            with is_finished() and not consumed.
  apply     the same torch code for every library: unpack the bitmask to bool and masked_fill -inf
            into float32 [batch, vocab] logits, median microseconds.
  --decode  also one decode step of the default model at `batch` rows (transformers' forward, KV
            cache of 100 tokens), for scale.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time

import torch
from _common import environment, table

import art
from art.base_models import resolve

RULER_SCHEMA = {
    "type": "object",
    "properties": {
        "scores": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "trajectory_id": {"type": "string"},
                    "explanation": {"type": "string"},
                    "score": {"type": "number"},
                },
                "required": ["trajectory_id", "explanation", "score"],
            },
        }
    },
    "required": ["scores"],
}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
                 "required": ["answer"]}
RULER_DOC = {"scores": [
    {"trajectory_id": "1", "explanation": "Found the right file and quoted the exact line asked for.",
     "score": 0.9},
    {"trajectory_id": "2", "explanation": "Correct answer but took many redundant tool calls to get there.",
     "score": 0.7},
    {"trajectory_id": "3", "explanation": "Gave up early and answered with a guess that is wrong.",
     "score": 0.1},
    {"trajectory_id": "4", "explanation": "Partly right; the summary misses two of the requested items.",
     "score": 0.45},
]}
CASES = {"ruler": (RULER_SCHEMA, json.dumps(RULER_DOC)), "answer": (ANSWER_SCHEMA, json.dumps({"answer": "maybe"}))}

BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens' logits to -inf: bit j of word i allows token 32*i + j (all three libraries)."""
    allowed = ((bitmask.unsqueeze(-1) >> BITS) & 1).bool().view(bitmask.shape[0], -1)[:, :logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1000


# One adapter per library: setup(tokenizer, vocab) once, compile(schema), matchers(compiled, n),
# fill(matchers, bitmask), consume(matchers, token) -> all ok, done(matchers) -> all finished after EOS.

class LLGuidance:
    name, package, modes = "llguidance", "llguidance", ("batch", "loop")

    def __init__(self, threads):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.threads = llguidance, threads
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def setup(self, tokenizer, vocab):
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=1)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matchers(self, compiled, n):  # one schema for the whole batch: copy the compiled matcher
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matchers, bitmask, mode):
        if mode == "batch":
            self.llg.torch.fill_next_token_bitmask_par(self.executor, list(zip(matchers, range(len(matchers)))),
                                                       bitmask)
        else:
            for i, m in enumerate(matchers):
                self.llg.torch.fill_next_token_bitmask(m, bitmask, i)

    def consume(self, matchers, token, mode):
        if mode == "batch":
            return all(self.executor.consume_token_par([(m, token) for m in matchers]))
        return all([m.consume_token(token) for m in matchers])

    def done(self, matchers):
        return all(m.is_stopped() and not m.is_error() for m in matchers)


class XGrammar:
    name, package, modes = "xgrammar", "xgrammar", ("batch", "loop")

    def __init__(self, threads):
        import xgrammar

        self.xgr, self.threads = xgrammar, threads
        self.batcher = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def setup(self, tokenizer, vocab):
        self.info = self.xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled, n):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers, bitmask, mode):
        if mode == "batch":
            self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)

    def consume(self, matchers, token, mode):
        if mode == "batch":
            return all(self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, [token] * len(matchers)))
        return all([m.accept_token(token) for m in matchers])

    def done(self, matchers):
        return all(m.is_terminated() for m in matchers)


class OutlinesCore:
    name, package, modes = "outlines-core", "outlines_core", ("loop",)  # no batch API

    def __init__(self, threads):
        import outlines_core

        self.oc = outlines_core

    def setup(self, tokenizer, vocab):
        # Vocabulary.from_pretrained downloads from the hub; build it from the local tokenizer instead,
        # keyed by each token's bytes (undoing the GPT-2 byte-to-unicode map of byte-level BPE).
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        tokens: dict[bytes, list[int]] = {}
        for text, token_id in tokenizer.get_vocab().items():
            if token_id not in special and token_id < vocab:
                tokens.setdefault(bytes(byte_of[c] for c in text), []).append(token_id)
        self.vocabulary = self.oc.Vocabulary(tokenizer.eos_token_id, tokens)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matchers(self, compiled, n):
        return [self.oc.Guide(compiled) for _ in range(n)]

    def fill(self, matchers, bitmask, mode):
        width = bitmask.shape[1]
        base, row_bytes = bitmask.data_ptr(), width * 4
        for i, g in enumerate(matchers):
            g.write_mask_into(base + i * row_bytes, width, 4)

    def consume(self, matchers, token, mode):
        if token == self.vocabulary.get_eos_token_id():  # advance() refuses EOS even where the mask allows it:
            return all(g.is_finished() for g in matchers)  # EOS ends generation, the Guide is not advanced
        for g in matchers:
            g.advance(token, return_tokens=False)
        return True  # advance raises on a disallowed token

    def done(self, matchers):
        return all(g.is_finished() for g in matchers)


LIBRARIES = (LLGuidance, XGrammar, OutlinesCore)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class RejectedError(Exception):
    """The library refused the HF tokenization of a valid document."""


def walk(lib, compiled, tokens, batch, vocab, mode, tokenizer):
    """Fill + check + consume along `tokens` in all rows; returns timings (µs) or raises on rejection."""
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    matchers, matchers_ms = timed(lambda: lib.matchers(compiled, batch))
    fills, consumes = [], []
    for pos, token in enumerate(tokens):
        _, ms = timed(lambda: lib.fill(matchers, bitmask, mode))
        fills.append(ms * 1000)
        allowed = (bitmask[:, token >> 5] >> (token & 31)) & 1
        if not bool(allowed.all()):
            raise RejectedError(f"mask disallows token {pos} ({token} {tokenizer.decode([token])!r})")
        ok, ms = timed(lambda: lib.consume(matchers, token, mode))
        consumes.append(ms * 1000)
        if not ok:
            raise RejectedError(f"consume refused token {pos} ({token} {tokenizer.decode([token])!r})")
    if not lib.done(matchers):
        raise RejectedError("not finished after EOS")
    return matchers_ms, fills, consumes, bitmask


def p90(values):
    return statistics.quantiles(values, n=10)[8] if len(values) > 1 else values[0]


def decode_step_ms(path, batch, repeats):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        cache = model(input_ids=torch.arange(100, 200).repeat(batch, 1), use_cache=True).past_key_values
        ids, where = torch.ones(batch, 1, dtype=torch.long), torch.full((batch, 1), 100)
        times = []
        for _ in range(repeats + 2):
            _, ms = timed(lambda: model(input_ids=ids, position_ids=where, past_key_values=cache, use_cache=True,
                                        logits_to_keep=1))
            times.append(ms)
    return round(statistics.median(times[2:]), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="walks of each document (a fresh batch each)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="worker threads of the batch APIs (llguidance LLExecutor, xgrammar)")
    parser.add_argument("--decode", action="store_true", help="also time one decode step of the default model")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    path = resolve(art.DEFAULT_MODEL)  # tokenizer and config only; the weights are not loaded
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    documents = {name: tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
                 for name, (_, text) in CASES.items()}

    # The mask applied to logits: the same torch code whichever library filled it (before any is loaded).
    logits = torch.randn(args.batch, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (args.batch, (vocab + 31) // 32), dtype=torch.int32)
    apply_times = []
    for _ in range(max(20, args.repeats * 10)):
        _, ms = timed(lambda: apply_bitmask(logits, bitmask))
        apply_times.append(ms * 1000)
    apply_us = round(statistics.median(apply_times[2:]), 1)

    results, skipped, rows = {}, {}, []
    for cls in LIBRARIES:
        try:
            version = importlib.metadata.version(cls.package)
            lib = cls(args.threads)
            _, setup_ms = timed(lambda: lib.setup(tokenizer, vocab))
        except Exception as exc:  # a library that does not install or import: skipped, with why
            skipped[cls.name] = f"{type(exc).__name__}: {exc}"
            continue
        out = results[cls.name] = {"version": version, "setup_ms": round(setup_ms, 1)}
        for case, (schema, _) in CASES.items():
            tokens = documents[case]
            try:
                compiled, compile_ms = timed(lambda: lib.compile(schema))
            except Exception as exc:
                out[case] = {"error": f"compile: {type(exc).__name__}: {exc}"}
                rows.append([f"{cls.name}  {case}", setup_ms, None, None, len(tokens), None, None, None, None, None,
                             "compile failed"])
                continue
            for mode in lib.modes:
                entry = out.setdefault(case, {"compile_ms": round(compile_ms, 1), "tokens": len(tokens)})
                try:
                    fills, consumes, created = [], [], []
                    walk(lib, compiled, tokens, args.batch, vocab, mode, tokenizer)  # warm-up (thread pools)
                    for _ in range(args.repeats):
                        matchers_ms, f, c, _ = walk(lib, compiled, tokens, args.batch, vocab, mode, tokenizer)
                        created.append(matchers_ms)
                        fills += f
                        consumes += c
                except Exception as exc:  # RejectedError, or the library's own error on a refused token
                    entry[mode] = {"error": f"{type(exc).__name__}: {exc}"}
                    rows.append([f"{cls.name}  {case}  {mode}", setup_ms, compile_ms, None, len(tokens), None, None,
                                 None, None, None, "REJECTED"])
                    continue
                mask = statistics.median(fills)
                entry[mode] = {"matchers_ms": round(statistics.median(created), 2),
                               "mask_us_median": round(mask, 1), "mask_us_p90": round(p90(fills), 1),
                               "mask_us_mean": round(statistics.fmean(fills), 1),
                               "mask_us_per_row": round(mask / args.batch, 2),
                               "consume_us_median": round(statistics.median(consumes), 1),
                               "walk_ms": round((sum(fills) + sum(consumes)) / args.repeats / 1000, 2)}
                e = entry[mode]
                rows.append([f"{cls.name}  {case}  {mode}", setup_ms, compile_ms, e["matchers_ms"], len(tokens),
                             e["mask_us_median"], e["mask_us_p90"], e["mask_us_mean"], e["mask_us_per_row"],
                             e["consume_us_median"],
                             "ok"])

    decode_ms = decode_step_ms(path, args.batch, max(5, args.repeats)) if args.decode else None

    print(table(["library  schema  mode", "setup ms", "compile ms", "matchers ms", "tokens", "mask us",
                 "mask p90 us", "mask mean us", "us / row", "consume us", "check"], rows))
    print(f"apply mask to float32 [{args.batch}, {vocab}] logits (torch, any library): {apply_us} us"
          + (f";  one decode step at {args.batch} rows: {decode_ms} ms" if decode_ms else ""))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    # Fastest: the lowest mean batch mask step on the RULER schema, over each library's modes.
    means = {f"{name} {mode}": out["ruler"][mode]["mask_us_mean"] for name, out in results.items()
             for mode in ("batch", "loop") if "mask_us_mean" in out.get("ruler", {}).get(mode, {})}
    fastest = min(means, key=means.get) if means else None
    print(f"fastest mean mask step at batch {args.batch} (ruler schema): {fastest}")
    print(json.dumps({"benchmark": "grammar_libraries", "fastest": fastest, "batch": args.batch, "repeats": args.repeats,
                      "threads": args.threads, "vocab": vocab, "documents_tokens": {k: len(v) for k, v in documents.items()},
                      "results": results, "skipped": skipped, "apply_mask_us": apply_us, "decode_step_ms": decode_ms,
                      "settings": {"model": art.DEFAULT_MODEL, "tokenizer": "HF, add_special_tokens=False, + EOS"},
                      **environment()}))


if __name__ == "__main__":
    main()
