"""text-generation: greedy tokens identical to ``model.generate(do_sample=False)`` and text equal to the
``text-generation`` pipeline, with the decode step compiled; batches of different lengths and max_new_tokens equal
to each request alone; seeded sampling reproducible in any batch; stop strings; streamed chunks that concatenate to
the answer; bad inputs answered 400 beside good neighbours; faults in the compiled step retried eagerly; the decode
step compiled for real (one graph per bucket, no graph break, nothing compiled after the warmup) for a full-attention
and a hybrid sliding-window cache. Through TorchServe (chunked HTTP streaming, server-side batching) in
test_torchserve.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from handlers.config import load_config
from handlers.errors import ConfigError, InvalidInput
from handlers.rungs import thread_guard as global_state
from handlers.serving.engine import Engine
from handlers.tasks.decoding import Completion, GenerationRequest
from tests import faulty_backends

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [
    ("The weather in Paris is", 20),
    ("Hi", 5),
    ("naïve café, ünïcode: 日本語のテキスト, emoji 🚀 and a longer sentence that goes on for a while", 30),
    ("one two three four five six seven eight nine ten eleven twelve", 12),
    ("A", 1),
]


@dataclass(frozen=True)
class DynamoCounts:
    graphs: int  # graphs compiled
    graph_breaks: int  # places a frame was split, with eager Python between its graphs
    frames_given_up: int  # frames dynamo was asked to compile and ran eagerly instead (no error is raised)

    def __sub__(self, before: DynamoCounts) -> DynamoCounts:
        return DynamoCounts(self.graphs - before.graphs, self.graph_breaks - before.graph_breaks,
                            self.frames_given_up - before.frames_given_up)


def dynamo_counts() -> DynamoCounts:
    """Dynamo's own counters for this process so far (read from torch, not through handlers.rungs.dynamo_counts: these
    tests judge the handler by dynamo itself)."""
    from torch._dynamo.utils import counters

    return DynamoCounts(graphs=counters["stats"]["unique_graphs"],
                        graph_breaks=sum(counters["graph_break"].values()),
                        frames_given_up=counters["frames"]["total"] - counters["frames"]["ok"])


def engine_for(model_dir: Path, **settings) -> Engine:
    """The shipped text-generation YAML, pointed at ``model_dir``, with ``settings`` laid over pt2_handlers (a
    ``pt2`` key replaces the compile section)."""
    raw = yaml.safe_load((REPO / "model_configs" / "tiny-llama-generation.yaml").read_text())
    if "pt2" in settings:
        raw["pt2"] = settings.pop("pt2")
    raw["pt2_handlers"].update(model_dir=str(model_dir), **settings)
    engine = Engine(load_config(raw), Path("/"), torch.device("cpu"), "llama")
    engine.load()
    return engine


@pytest.fixture(scope="module")
def llama_dir(task_model_dirs) -> Path:
    return task_model_dirs["tiny-llama"]


@pytest.fixture(scope="module")
def compiled_load(llama_dir) -> tuple[Engine, DynamoCounts]:
    """tiny-llama (full attention) as shipped: inductor, buckets 1x256 and 4x256; and what dynamo did at load."""
    before = dynamo_counts()
    engine = engine_for(llama_dir)
    assert engine.active_rung == "compile", engine.describe()["optimization"]["attempts"]
    return engine, dynamo_counts() - before


@pytest.fixture(scope="module")
def compiled(compiled_load) -> Engine:
    return compiled_load[0]


@pytest.fixture(scope="module")
def hybrid_load(task_model_dirs) -> tuple[Engine, DynamoCounts]:
    """tiny-qwen2-hybrid (full and sliding-window layers, a 16-token window that fills within a decode) with the
    shipped inductor compile over small buckets (1x32, 2x32); and what dynamo did at load."""
    before = dynamo_counts()
    engine = engine_for(task_model_dirs["tiny-qwen2-hybrid"], max_length=32, ladder=["compile", "eager"],
                        shapes={"batch_sizes": [1, 2], "seq_lengths": [32]})
    assert engine.active_rung == "compile", engine.describe()["optimization"]["attempts"]
    return engine, dynamo_counts() - before


@pytest.fixture(scope="module")
def eager(llama_dir) -> Engine:
    return engine_for(llama_dir, pt2={"compile": {"enable": False}}, ladder=["eager"])


@pytest.fixture(scope="module")
def reference(llama_dir):
    """``(token ids, pipeline text)`` of greedy generation, as transformers does it eagerly."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")

    def generate(prompt: str, max_new_tokens: int, return_full_text: bool = True) -> tuple[list[int], str]:
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        (text,) = pipe(prompt, max_new_tokens=max_new_tokens, do_sample=False, return_full_text=return_full_text)
        return ids[0, inputs["input_ids"].shape[1]:].tolist(), text["generated_text"]

    return generate


def one(engine: Engine, body) -> dict:
    (answer,) = engine.predict([body])
    assert not isinstance(answer, Exception), answer
    return answer[0]


def test_greedy_tokens_equal_generate_and_text_equals_the_pipeline(compiled, reference):
    for prompt, max_new in PROMPTS:
        ids, text = reference(prompt, max_new)
        answer = one(compiled, {"text": prompt, "max_new_tokens": max_new, "details": True})
        assert answer["details"]["token_ids"] == ids, prompt
        assert answer["generated_text"] == text
        assert answer["details"]["finish_reason"] == "length" and answer["details"]["seed"] is None
    _, completion = reference(PROMPTS[0][0], 20, return_full_text=False)
    assert one(compiled, {"text": PROMPTS[0][0], "max_new_tokens": 20, "return_full_text": False}) == {
        "generated_text": completion}
    runtime = compiled.describe()["optimization"]["runtime"]
    assert runtime["compiles_after_ready"] == 0 and runtime["eager_batches"] == 0 and runtime["runtime_failures"] == 0


def test_a_batch_with_different_lengths_and_max_new_tokens_equals_each_request_alone(compiled):
    bodies = [{"text": prompt, "max_new_tokens": max_new, "details": True} for prompt, max_new in PROMPTS]
    alone = [one(compiled, body) for body in bodies]
    together = compiled.predict(bodies)  # 5 requests: a chunk of 4 and one of 1, each padded to its bucket
    assert [answer[0] for answer in together] == alone
    assert [len(answer["details"]["token_ids"]) for answer in alone] == [max_new for _, max_new in PROMPTS]


def test_requests_that_do_not_fit_one_cache_together_are_decoded_apart(eager):
    long_prompt = {"text": "word " * 100, "max_new_tokens": 20, "details": True}  # 201 prompt tokens
    long_answer = {"text": "Hi", "max_new_tokens": 200, "details": True}  # 201 + 200 > 256: not in one batch
    together = eager.predict([long_prompt, long_answer, {"text": "Hi", "max_new_tokens": 3}])
    assert [answer[0] for answer in together[:2]] == [one(eager, long_prompt), one(eager, long_answer)]
    assert len(together[1][0]["details"]["token_ids"]) == 200 or together[1][0]["details"]["finish_reason"] == "eos"


def test_the_decode_step_is_what_compiles(compiled):
    optimization = compiled.describe()["optimization"]
    attempts = optimization["attempts"]
    # the openvino rung, where the YAML lists it, leaves the decode loop to the compile rungs
    skipped = [a for a in attempts if a["rung"] == "openvino"]
    assert all(a["status"] == "skipped" and "decode loop" in a["reason"] for a in skipped), skipped
    (attempt,) = [a for a in attempts if a["rung"] != "openvino"]
    assert attempt["quality"] == {"metric": "greedy_token_agreement", "value": 1.0, "threshold": 1.0}
    assert optimization["dtype"] == "float32" and optimization["shapes"]["seq_lengths"] == [256]
    assert optimization["shapes"]["batch_sizes"] == [1, 4]
    assert compiled.describe()["inputs"] == {"max_length": 256, "too_long": "reject", "default_max_new_tokens": 64}


@pytest.mark.parametrize("loaded", ["compiled_load", "hybrid_load"])
def test_the_decode_step_compiles_one_graph_per_bucket_and_nothing_after_the_warmup(loaded, request):
    """Dynamo can run a frame eagerly without an error (a guard that changes every step, the recompile limit, a
    graph break): its own counters say whether the step really compiled, and stays compiled."""
    engine, at_load = request.getfixturevalue(loaded)
    buckets = engine.shapes.warmup_shapes()
    counts = engine.cpu.runs_at or (torch.get_num_threads(),)
    # One set of graphs for every count on shared cores (handlers.rungs.thread_guard); torch 2.8 compiles per count.
    sets = 1 if engine.cpu.share is not None and global_state.guard_can_be_left_out() else len(counts)
    assert at_load == DynamoCounts(graphs=len(buckets) * sets, graph_breaks=0, frames_given_up=0)
    task = engine.task
    before, threads = dynamo_counts(), torch.get_num_threads()
    try:
        for count in counts:  # the same buckets again, through the served step, at each count the share may give
            torch.set_num_threads(count)
            for batch in task.warmup_batches(buckets):
                task.prove(engine.forward_step, batch)
    finally:
        torch.set_num_threads(threads)
    assert dynamo_counts() - before == DynamoCounts(graphs=0, graph_breaks=0, frames_given_up=0)
    runtime = engine.describe()["optimization"]["runtime"]
    assert runtime["eager_batches"] == 0 and runtime["compiles_after_ready"] == 0


def test_a_decode_step_that_recompiles_every_token_is_not_accepted_as_compiled(task_model_dirs, monkeypatch):
    """The provoking case, kept: transformers' own static cache for a sliding-window model counts its length in a
    Python int, so each decode step guards on a new value and recompiles, until dynamo gives up on the frame and
    runs it eagerly, without an error. The ladder must see it (dynamo's counters over the warmup) and refuse the
    rung, not call it compiled; fp32 eager then serves."""
    import transformers

    from handlers.tasks import generation

    monkeypatch.setattr(generation, "static_cache", lambda config, cache_length: transformers.StaticCache(
        config=config, max_cache_len=cache_length))
    torch._dynamo.reset()
    engine = engine_for(task_model_dirs["tiny-qwen2-hybrid"], max_length=32, ladder=["compile", "eager"],
                        shapes={"batch_sizes": [1], "seq_lengths": [32]},
                        pt2={"compile": {"enable": True, "backend": "eager"}})
    optimization = engine.describe()["optimization"]
    refused = optimization["attempts"][0]
    assert (refused["rung"], refused["status"], optimization["active"]) == ("compile", "failed", "eager"), refused
    assert refused["reason"].startswith("NotCompiled: "), refused["reason"]
    assert "the warmup compiled" in refused["reason"] and "a guard changes between calls" in refused["reason"]
    assert refused["dynamo"]["graphs"] > 1 and refused["dynamo"]["frames_given_up"] == 0  # one graph per token


def test_a_sliding_window_model_generates_what_generate_does(hybrid_load, task_model_dirs):
    """The sliding layers of its cache are full-length, their window kept by the mask: the same tokens as
    ``model.generate``, whose cache drops what leaves the window (prompts past the 16-token window too)."""
    import transformers

    engine, _ = hybrid_load
    model_dir = task_model_dirs["tiny-qwen2-hybrid"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = [("Hi", 12), ("The weather in Paris is", 14), ("one two three four five six seven eight nine ten", 12)]
    bodies = [{"text": prompt, "max_new_tokens": max_new, "details": True} for prompt, max_new in prompts]
    answers = engine.predict(bodies)  # batches of 2 and 1, left-padded
    for (prompt, max_new), answer in zip(prompts, answers, strict=True):
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
        assert answer[0]["details"]["token_ids"] == ids[0, inputs["input_ids"].shape[1]:].tolist(), prompt
    assert [len(tokenizer(prompt)["input_ids"]) for prompt, _ in prompts] == [2, 10, 19]  # the last one: past 16


def test_sampling_with_a_seed_is_reproducible_in_any_batch(compiled):
    seeded = {"text": "Once upon a time", "max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 40,
              "seed": 1234, "details": True}
    alone = one(compiled, seeded)
    mixed = compiled.predict([{"text": "x", "max_new_tokens": 3}, seeded, {**seeded, "seed": 99}])
    assert mixed[1][0] == alone and alone["details"]["seed"] == 1234
    assert mixed[2][0]["details"]["token_ids"] != alone["details"]["token_ids"]
    greedy = one(compiled, {"text": "Once upon a time", "max_new_tokens": 16, "details": True})
    assert greedy["details"]["token_ids"] != alone["details"]["token_ids"]
    unseeded = one(compiled, {"text": "Once upon a time", "max_new_tokens": 16, "do_sample": True, "details": True})
    replay = one(compiled, {"text": "Once upon a time", "max_new_tokens": 16, "do_sample": True,
                            "seed": unseeded["details"]["seed"], "details": True})
    assert replay == unseeded  # the seed a sampled answer reports reproduces it
    assert one(compiled, {"text": "Once upon a time", "max_new_tokens": 16, "temperature": 0, "details": True}
               )["details"]["token_ids"] == greedy["details"]["token_ids"]  # temperature 0 is greedy


def test_extreme_temperatures_sample_without_failing_the_batch(eager):
    """A temperature so small that float32 logits overflow used to make every row's softmax NaN; its limit is
    greedy decoding, and a huge one samples (nearly) uniformly."""
    greedy = one(eager, {"text": "Once upon a time", "max_new_tokens": 8, "details": True})
    tiny, huge = eager.predict([{"text": "Once upon a time", "max_new_tokens": 8, "temperature": t, "seed": 3,
                                 "details": True} for t in (1e-320, 1e300)])
    assert tiny[0]["details"]["token_ids"] == greedy["details"]["token_ids"]
    assert len(huge[0]["details"]["token_ids"]) == 8


def test_a_stop_string_ends_the_text_before_it(compiled):
    full = one(compiled, {"text": "The weather in Paris is", "max_new_tokens": 20, "return_full_text": False})
    text = full["generated_text"]
    stop = text[8:11]
    cut = text.find(stop)
    answer = one(compiled, {"text": "The weather in Paris is", "max_new_tokens": 20, "return_full_text": False,
                            "stop": ["never appears", stop], "details": True})
    assert answer["generated_text"] == text[:cut] and answer["details"]["finish_reason"] == "stop"
    assert len(answer["details"]["token_ids"]) < 20


def test_streamed_chunks_concatenate_to_the_answer(compiled):
    bodies = [{"text": prompt, "max_new_tokens": max_new, "stream": True, "return_full_text": False}
              for prompt, max_new in PROMPTS[:3]]
    bodies.append({"text": "not streamed", "max_new_tokens": 8})
    text = one(compiled, {"text": PROMPTS[0][0], "max_new_tokens": 20, "return_full_text": False})["generated_text"]
    bodies.append({"text": PROMPTS[0][0], "max_new_tokens": 20, "stream": True, "return_full_text": False,
                   "stop": text[12:15]})
    chunks: list[dict] = []
    answers = compiled.predict(bodies, emit=chunks.append)
    assert 3 not in {index for chunk in chunks for index in chunk}  # only the requests that asked stream
    for index in (0, 1, 2, 4):
        pieces = [chunk[index] for chunk in chunks if index in chunk]
        assert len(pieces) > 1
        assert "".join(piece["text"] for piece in pieces) == answers[index][0]["generated_text"]
        assert answers[index] == [one(compiled, {**bodies[index], "stream": False})]
    assert len([chunk for chunk in chunks if 0 in chunk]) == 20  # one chunk per token


def test_stream_holds_back_partial_characters_and_possible_stop_strings(eager):
    tokenizer = eager.task.tokenizer
    text = "日本語 🚀 then a sto then stop here"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > len(text.split()), "the multi-byte characters should span several byte-level tokens"
    request = GenerationRequest("p", (1,), max_new_tokens=len(ids), stop=("stop",), stream=True)
    completion = Completion(request, tokenizer, frozenset(), watch=True)
    streamed, held = "", []
    for count, token in enumerate(ids, 1):
        streamed += completion.add(token)
        decoded = tokenizer.decode(ids[:count])
        if decoded.endswith("\ufffd") or decoded.endswith(" a st") or decoded.endswith(" a sto"):
            held.append(decoded)
            assert len(streamed) < len(decoded.rstrip("\ufffd")) or decoded.endswith("\ufffd"), decoded
        assert "\ufffd" not in streamed
        if completion.done:
            break
    assert len(held) >= 5  # the byte tokens of 日, 本, 語 and 🚀, then " a st" and " a sto"
    assert streamed == completion.text == "日本語 🚀 then a sto then "
    assert completion.finish_reason == "stop" and len(completion.token_ids) == ids.index(tokenizer.vocab["op"]) + 1


def test_eos_ends_a_row_and_the_batch_stops_when_every_row_is_done(eager):
    tokenizer = eager.task.tokenizer
    request = GenerationRequest("p", (1,), max_new_tokens=10, stream=True)
    completion = Completion(request, tokenizer, frozenset({tokenizer.eos_token_id}), watch=True)
    hello = tokenizer("hello")["input_ids"]
    assert "".join(completion.add(token) for token in hello) == "hello" and not completion.done
    assert completion.add(tokenizer.eos_token_id) == ""
    assert completion.finish_reason == "eos" and completion.text == "hello"
    assert completion.token_ids == [*hello, tokenizer.eos_token_id]


BAD = [
    ({"text": "hi", "temperature": "hot"}, '"temperature" must be a number in [0, inf]'),
    ({"text": "hi", "temperature": -1}, '"temperature" must be a number'),
    ({"text": "hi", "top_p": 0}, '"top_p" must be a number in (0, 1]'),
    ({"text": "hi", "top_p": 1.5}, '"top_p" must be a number in (0, 1]'),
    ({"text": "hi", "top_k": -1}, '"top_k" must be a non-negative integer'),
    ({"text": "hi", "top_k": 2.5}, '"top_k" must be a non-negative integer'),
    ({"text": "hi", "seed": -3}, '"seed" must be an integer in [0, 2**63 - 1]'),
    ({"text": "hi", "max_new_tokens": 0}, '"max_new_tokens" must be a positive integer'),
    ({"text": "hi", "max_new_tokens": "10"}, '"max_new_tokens" must be a positive integer'),
    ({"text": "hi", "max_new_tokens": 256}, '"max_new_tokens" is 256; this model reads at most 256 tokens'),
    ({"text": "hi", "do_sample": False, "temperature": 0.5}, "temperature apply only to sampling"),
    ({"text": "hi", "do_sample": True, "temperature": 0}, '"temperature": 0 means greedy decoding'),
    ({"text": "hi", "do_sample": "yes"}, '"do_sample" must be true or false'),
    ({"text": "hi", "stream": 1}, '"stream" must be true or false'),
    ({"text": "hi", "stop": []}, '"stop" must be a string or a list of 1 to 8 non-empty strings'),
    ({"text": "hi", "stop": [""]}, '"stop" must be a string or a list'),
    ({"text": "hi", "stop": 5}, '"stop" must be a string or a list'),
    ({"text": "hi", "beams": 4}, "unknown key(s) beams; allowed here: text, max_new_tokens"),
    ({"text": ["a", "b"]}, '"text" must be a string (one prompt per request), got list'),
    ({"prompt": "hi"}, 'send the prompt as "text"'),
    ({"text": "   "}, "the prompt is empty"),
    ("", "the prompt is empty"),
    ([1, 2], "expected text or a JSON object, got JSON list"),
    ({"text": "word " * 300, "max_new_tokens": 10}, "the prompt is 601 tokens long and max_new_tokens is 10; this "
                                                     "model reads at most 256 tokens in all"),
]


def test_bad_inputs_get_a_400_naming_the_problem_and_their_neighbours_are_answered(eager):
    good = {"text": "The weather in Paris is", "max_new_tokens": 6}
    want = one(eager, good)
    answers = eager.predict([good, *(body for body, _ in BAD), good])
    assert answers[0] == answers[-1] == [want]
    for (body, message), answer in zip(BAD, answers[1:-1], strict=True):
        assert isinstance(answer, InvalidInput) and answer.status == 400, (body, answer)
        assert message in answer.message, (body, answer.message)


def test_a_prompt_too_long_is_truncated_from_the_start_when_configured(llama_dir):
    engine = engine_for(llama_dir, pt2={"compile": {"enable": False}}, ladder=["eager"], too_long="truncate")
    long_prompt = "word " * 300
    answer = one(engine, {"text": long_prompt, "max_new_tokens": 10, "details": True})
    assert answer["details"]["prompt_tokens"] == 246 and answer["generated_text"].startswith(long_prompt)
    assert one(engine, {"text": long_prompt, "details": True})["details"]["prompt_tokens"] == 256 - 64  # default


def test_a_rung_whose_greedy_tokens_differ_is_refused_at_load(llama_dir, eager, reference):
    engine = engine_for(llama_dir, pt2={"compile": {"enable": True, "backend": "tests.faulty_backends:negated"}},
                        ladder=["compile", "eager"], shapes={"batch_sizes": [1], "seq_lengths": [64]})
    (attempt, fallback) = engine.describe()["optimization"]["attempts"]
    assert attempt["status"] == "failed" and attempt["quality"]["metric"] == "greedy_token_agreement"
    assert attempt["quality"]["value"] < 1.0 and fallback["rung"] == "eager"
    ids, _ = reference("The weather in Paris is", 12)
    assert one(engine, {"text": "The weather in Paris is", "max_new_tokens": 12, "details": True}
               )["details"]["token_ids"] == ids


def test_a_decode_step_failing_after_ready_is_retried_eagerly_then_demoted(llama_dir, reference):
    engine = engine_for(llama_dir, pt2={"compile": {"enable": True,
                                                    "backend": "tests.faulty_backends:breaks_on_demand"}},
                        ladder=["compile", "eager"], shapes={"batch_sizes": [1], "seq_lengths": [64]},
                        max_runtime_failures=3)
    assert engine.active_rung == "compile"
    ids, _ = reference("The weather in Paris is", 12)
    body = {"text": "The weather in Paris is", "max_new_tokens": 12, "details": True, "stream": True}
    faulty_backends.BROKEN["now"] = True
    try:
        chunks: list[dict] = []
        (answer,) = engine.predict([body], emit=chunks.append)
    finally:
        faulty_backends.BROKEN["now"] = False
    assert answer[0]["details"]["token_ids"] == ids  # each failed step was re-run eagerly, in place
    assert "".join(chunk[0]["text"] for chunk in chunks) == answer[0]["generated_text"].removeprefix(body["text"])
    runtime = engine.describe()["optimization"]["runtime"]
    assert runtime["demoted"] and runtime["runtime_failures"] == 3 and engine.active_rung == "eager"
    assert "injected failure" in runtime["last_failure"]


@pytest.mark.parametrize("settings, message", [
    ({"dtype": "bfloat16"}, "text-generation serves float32"),
    ({"shapes": {"policy": "dynamic", "batch_sizes": [1, 2]}}, "text-generation compiles static shapes only"),
    ({"quality_gate": {"min_token_agreement": 1.5}}, "min_token_agreement is a share of tokens in [0, 1]"),
    ({"quality_gate": {"min_cosine": 0.9}}, "unknown key(s) min_cosine"),
])
def test_config_mistakes_are_named(settings, message):
    with pytest.raises(ConfigError) as error:
        load_config({"pt2_handlers": {"task": "text-generation", **settings}})
    assert message in str(error.value)


def test_dtype_auto_serves_float32_and_says_why(eager):
    optimization = eager.describe()["optimization"]
    assert optimization["dtype"] == "float32"
    assert optimization["dtype_reason"].startswith((
        "auto: the CPU has none of amx_bf16/avx512_bf16, so bf16 would be emulated",  # then maybe "; held back here"
        "text-generation serves float32: its gate wants greedy tokens identical to fp32 eager's, which half types "
        "rarely keep"))
