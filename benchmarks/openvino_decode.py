"""text-generation's decode step on OpenVINO vs torch.compile: ms per step, batch 1 and 4, cache length 256.

The shipped ``model_configs/tiny-llama-generation.yaml`` compiles the per-token decode step (``DecodeStep``: the
causal LM over one new token per row against a transformers ``StaticCache``) with inductor and its C++ wrapper. This
benchmark times that step, without TorchServe, in four ways on the same prompts and model (tiny-llama, float32):

* ``eager``: ``DecodeStep`` with the static cache, as the eager rung runs it (the baseline);
* ``compile``: ``torch.compile(DecodeStep, backend="inductor", options={"cpp_wrapper": True}, dynamic=False)``,
  what the model YAML serves today;
* ``ov_stateless``: the step with its KV cache as explicit inputs and outputs (``past`` in, updated cache out),
  exported with ``torch.export`` and converted by ``openvino.convert_model``, shapes made static per batch, and
  compiled for the CPU in f32 (``INFERENCE_PRECISION_HINT`` f32, ``INFERENCE_NUM_THREADS`` = torch's threads,
  ``PERFORMANCE_HINT`` LATENCY). Each step feeds the whole cache in and reads it back out;
* ``ov_stateful``: the same model made stateful (``apply_make_stateful_transformation``, as optimum-intel does): the
  cache stays inside OpenVINO as variables, and a step passes only the new token, the mask and the positions.

Every variant starts from the same eager prefill (the handler's prefill is eager too); the OpenVINO variants have the
prefilled cache copied in (as inputs, or into the variables). Before any timing, each variant's greedy tokens over
``--check-steps`` steps are compared with eager's (the share of tokens before the first difference, worst row).
Then, per round, each variant runs ``--steps`` decode steps in turn (interleaved, so drift on a shared machine hits
all alike); a round's value is the median ms of its steps, leaving out the first step after switching variants
(a preempted step on a shared machine moves a median little). The table gives the median over rounds. Conversion and
compile times are reported per batch. torch and OpenVINO run on the same number of threads (``--threads``, default
torch's): on a machine shared with other work, one thread per runtime avoids waits at every kernel's barrier for a
thread that was descheduled, which swamp a step this small.

    .venv/bin/python -m benchmarks.openvino_decode [--rounds N] [--steps 32] [--threads N] [--cache-dir DIR]

The plot needs matplotlib (the bench extra); without it the CSV, JSON and table are still written.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import (DEFAULT_OUT, REPO, log, markdown_table, run_header, write_csv, write_json,
                                write_plot)

PROMPTS = ["Serving compiled models in production", "The quick brown fox", "A longer prompt about the latency "
           "of every request that a server answers while it batches", "Tea"]
BATCHES = (1, 4)
CACHE_LENGTH = 256  # the shipped YAML's one KV cache length
VARIANTS = ("eager", "compile", "ov_stateless", "ov_stateful")
KV_INPUTS = 4  # input_ids, attention_mask, position_ids, cache_position come before the cache tensors

# A step: (attention mask, new tokens (rows,), position ids (rows, 1), cache position) -> float32 logits (rows, vocab)
Step = Callable[[Any, Any, Any, int], Any]


def load_model(model_dirs: Path) -> Any:
    import torch
    import transformers

    from tests import tiny_models

    path = tiny_models.build("tiny-llama", model_dirs)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def prompts_batch(tokenizer: Any, rows: int) -> tuple[Any, Any]:
    """``rows`` prompts, left-padded as the handler pads them."""
    import torch

    ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS[:rows]]
    longest = max(len(row) for row in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((rows, longest), pad, dtype=torch.long)
    attention_mask = torch.zeros((rows, longest), dtype=torch.long)
    for row, tokens in enumerate(ids):
        input_ids[row, -len(tokens):] = torch.tensor(tokens)
        attention_mask[row, -len(tokens):] = 1
    return input_ids, attention_mask


class Prefilled:
    """The eager prefill of a batch into a static cache: what every variant's decode starts from."""

    def __init__(self, step: Any, config: Any, input_ids: Any, attention_mask: Any):
        import torch

        from handlers.tasks.decoding import static_cache

        self.rows, self.prompt_length = input_ids.shape
        self.cache = static_cache(config, CACHE_LENGTH)
        self.mask = torch.zeros((self.rows, CACHE_LENGTH), dtype=torch.long)
        self.mask[:, :self.prompt_length] = attention_mask
        positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        with torch.inference_mode():
            self.logits = step(attention_mask=self.mask, input_ids=input_ids, position_ids=positions,
                               cache_position=torch.arange(self.prompt_length), cache=self.cache)
        self.next_position = positions[:, -1:] + 1
        self.keys_values = [tensor.clone() for layer in self.cache.layers for tensor in (layer.keys, layer.values)]
        self.lengths = [layer.cumulative_length.clone() for layer in self.cache.layers]

    def restore(self, cache: Any) -> None:
        """Put the prefilled state into ``cache`` (a static cache of the same shape, in place: a compiled step
        is specialized to its tensors). In inference mode, as the handler's decode loop makes its caches."""
        import torch

        with torch.inference_mode():
            self._restore(cache)

    def _restore(self, cache: Any) -> None:
        for index, layer in enumerate(cache.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(self.keys_values[2 * index], self.keys_values[2 * index + 1])
            layer.keys.copy_(self.keys_values[2 * index])
            layer.values.copy_(self.keys_values[2 * index + 1])
            layer.cumulative_length.copy_(self.lengths[index])


def decode(step: Step, start: Prefilled, steps: int, times: list[float] | None = None) -> Any:
    """Greedy tokens of ``steps`` decode steps from the prefill, (rows, steps + 1) counting the prefill's pick;
    each step's seconds (the step and its argmax) appended to ``times``."""
    import torch

    mask = start.mask.clone()
    tokens = start.logits.argmax(dim=-1)
    picked = [tokens]
    next_position = start.next_position.clone()
    with torch.inference_mode():
        for index in range(steps):
            position = start.prompt_length + index
            mask[:, position] = 1
            began = time.perf_counter()
            tokens = step(mask, tokens, next_position, position).argmax(dim=-1)
            if times is not None:
                times.append(time.perf_counter() - began)
            picked.append(tokens)
            next_position = next_position + 1
    return torch.stack(picked, dim=1)


def torch_step(module: Any, start: Prefilled, config: Any) -> tuple[Step, Callable[[], None]]:
    """A step of ``module`` (eager or compiled ``DecodeStep``) against a static cache of its own, and the reset
    that puts the prefill back into that cache."""
    import torch

    from handlers.tasks.decoding import static_cache

    cache = static_cache(config, CACHE_LENGTH)
    start.restore(cache)

    def step(mask: Any, tokens: Any, next_position: Any, position: int) -> Any:
        return module(attention_mask=mask, input_ids=tokens.unsqueeze(1), position_ids=next_position,
                      cache_position=torch.tensor([position]), cache=cache)

    return step, lambda: start.restore(cache)


def explicit_kv_module(model: Any) -> Any:
    """``DecodeStep`` with the cache as tensors: (input_ids, attention_mask, position_ids, cache_position, past)
    -> (logits, updated keys and values, layer by layer). The cache tensors are copied before the step writes its
    token into them, so the export has no input mutation: the updated cache is an output."""
    import torch

    from handlers.tasks.decoding import DecodeStep, static_cache

    class ExplicitKvStep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = DecodeStep(model)
            self.config = model.config

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    cache_position: torch.Tensor, past: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            cache = static_cache(self.config, attention_mask.shape[1])
            for index, layer in enumerate(cache.layers):
                keys, values = past[2 * index].clone(), past[2 * index + 1].clone()
                layer.keys, layer.values = keys, values
                layer.device = keys.device
                layer.batch_size, layer.num_heads = keys.shape[:2]
                layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
                layer.cumulative_length = cache_position[0].clone()  # where this step's token goes
                layer.is_initialized = True
            logits = self.step(attention_mask, input_ids, position_ids, cache_position, cache)
            return (logits, *[tensor for layer in cache.layers for tensor in (layer.keys, layer.values)])

    return ExplicitKvStep().eval()


def convert(openvino: Any, model: Any, start: Prefilled) -> tuple[Any, float]:
    """The explicit-KV step exported at this batch's shapes and converted; its inputs made static."""
    import torch

    example = (torch.zeros((start.rows, 1), dtype=torch.long), start.mask.clone(), start.next_position.clone(),
               torch.tensor([start.prompt_length]), [tensor.clone() for tensor in start.keys_values])
    began = time.perf_counter()
    with torch.no_grad():
        exported = torch.export.export(explicit_kv_module(model), example, strict=False)
    converted = openvino.convert_model(exported)
    flat = [*example[:KV_INPUTS], *example[KV_INPUTS]]
    converted.reshape({port: openvino.PartialShape(list(tensor.shape))
                       for port, tensor in zip(converted.inputs, flat, strict=True)})
    return converted, time.perf_counter() - began


def ov_config() -> dict[str, Any]:
    import torch

    return {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": torch.get_num_threads(),
            "PERFORMANCE_HINT": "LATENCY"}


def ov_stateless(openvino: Any, converted: Any, start: Prefilled) -> tuple[Step, Callable[[], None], float]:
    """The converted step compiled as is: each step sends the cache in and takes the updated one back."""
    import numpy
    import torch

    began = time.perf_counter()
    compiled = openvino.Core().compile_model(converted, "CPU", ov_config())
    compile_s = time.perf_counter() - began
    request = compiled.create_infer_request()
    past: list[Any] = []

    def reset() -> None:
        past[:] = [tensor.numpy().copy() for tensor in start.keys_values]

    def step(mask: Any, tokens: Any, next_position: Any, position: int) -> Any:
        inputs = [tokens.unsqueeze(1).numpy(), mask.numpy(), next_position.numpy(),
                  numpy.array([position], dtype=numpy.int64), *past]
        outputs = request.infer(dict(enumerate(inputs)), share_inputs=True).to_tuple()
        past[:] = outputs[1:]
        return torch.from_numpy(outputs[0])

    reset()
    return step, reset, compile_s


def ov_stateful(openvino: Any, converted: Any, start: Prefilled) -> tuple[Step, Callable[[], None], float]:
    """The converted step with each cache input tied to its updated output as an OpenVINO variable."""
    import numpy
    import torch
    from openvino._offline_transformations import apply_make_stateful_transformation

    model = converted.clone()
    parameters, results = model.get_parameters(), model.get_results()
    names = [parameter.get_friendly_name() for parameter in parameters[KV_INPUTS:]]
    pairs = list(zip(parameters[KV_INPUTS:], results[1:], strict=True))
    apply_make_stateful_transformation(model, pairs)
    began = time.perf_counter()
    compiled = openvino.Core().compile_model(model, "CPU", ov_config())
    compile_s = time.perf_counter() - began
    request = compiled.create_infer_request()
    # Each variable is named after the input it replaced: match them to the cache tensors by that name.
    states = {}
    for state in request.query_state():
        owner = [index for index, name in enumerate(names) if state.name.startswith(name)]
        owner = max(owner, key=lambda index: len(names[index]))  # "past" vs "past_1"-like prefixes: the longest
        states[owner] = state
    if sorted(states) != list(range(len(names))):
        raise RuntimeError(f"variables {[s.name for s in request.query_state()]} do not match inputs {names}")

    def reset() -> None:
        for index, state in states.items():
            state.state = openvino.Tensor(start.keys_values[index].numpy().copy())

    def step(mask: Any, tokens: Any, next_position: Any, position: int) -> Any:
        inputs = [tokens.unsqueeze(1).numpy(), mask.numpy(), next_position.numpy(),
                  numpy.array([position], dtype=numpy.int64)]
        return torch.from_numpy(request.infer(dict(enumerate(inputs)), share_inputs=True)[0])

    reset()
    return step, reset, compile_s


def agreement(got: Any, want: Any) -> float:
    """Share of tokens before the first difference, worst row (the quality gate's measure)."""
    same = (got == want).long().cumprod(dim=1).sum(dim=1)
    return (same.float() / want.shape[1]).min().item()


Steps = dict[str, tuple[Step, Callable[[], None]]]


def add_openvino(steps: Steps, info: dict[str, Any], openvino: Any, model: Any, start: Prefilled) -> None:
    """Convert the explicit-KV step for this batch and add its stateless and stateful variants to ``steps``; a
    failure is logged and kept in ``info``, and the rest are timed without it."""
    rows = start.rows
    try:
        converted, convert_s = convert(openvino, model, start)
    except Exception as exc:  # noqa: BLE001 -- report it, time the rest
        info["ov_convert_error"] = f"{type(exc).__name__}: {exc}"
        log(f"b{rows}: OpenVINO conversion failed: {info['ov_convert_error']}")
        return
    info["ov_convert_s"] = round(convert_s, 1)
    log(f"b{rows}: torch.export + openvino.convert_model took {convert_s:.1f}s")
    for name, build in (("ov_stateless", ov_stateless), ("ov_stateful", ov_stateful)):
        try:
            step, reset, compile_s = build(openvino, converted, start)
        except Exception as exc:  # noqa: BLE001 -- report it, time the rest
            info[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            log(f"b{rows}: {name} failed: {info[f'{name}_error']}")
            continue
        steps[name] = (step, reset)
        info[f"{name}_compile_s"] = round(compile_s, 2)
        log(f"b{rows}: {name} compiled in {compile_s:.2f}s")


def time_rounds(steps: Steps, start: Prefilled, rounds: int, count: int) -> dict[str, list[float]]:
    """Per variant, each round's median ms per step over ``count`` steps (the first, after the switch, left out)."""
    for step, reset in steps.values():  # a warmup round, untimed
        decode(step, start, count)
        reset()
    per_round: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(rounds):  # interleaved, so drift on a shared machine hits every variant alike
        for name, (step, reset) in steps.items():
            times: list[float] = []
            decode(step, start, count, times)
            reset()
            per_round[name].append(1000 * statistics.median(times[1:]))
        log(f"  b{start.rows} round {index + 1}/{rounds}: ms/step "
            + ", ".join(f"{name} {values[-1]:.3f}" for name, values in per_round.items()))
    return per_round


def measure(rows: int, args: argparse.Namespace, openvino: Any, model: Any, tokenizer: Any, eager: Any,
            compiled: Any) -> dict[str, Any]:
    """One batch: prefill, compile and convert, check the greedy tokens, then time the rounds."""
    input_ids, attention_mask = prompts_batch(tokenizer, rows)
    start = Prefilled(eager, model.config, input_ids, attention_mask)
    info: dict[str, Any] = {"batch": rows, "cache_length": CACHE_LENGTH, "prompt_length": start.prompt_length}
    steps: Steps = {"eager": torch_step(eager, start, model.config),
                    "compile": torch_step(compiled, start, model.config)}
    want = decode(steps["eager"][0], start, args.check_steps)
    steps["eager"][1]()
    began = time.perf_counter()
    decode(steps["compile"][0], start, 1)  # compiles at the first step
    info["compile_first_step_s"] = round(time.perf_counter() - began, 1)
    log(f"b{rows}: torch.compile's first step (compile) took {info['compile_first_step_s']}s")
    add_openvino(steps, info, openvino, model, start)
    for name, (step, reset) in steps.items():
        reset()
        info[f"{name}_agreement"] = agreement(decode(step, start, args.check_steps), want)
        reset()
        log(f"b{rows}: {name} greedy-token agreement with eager over {args.check_steps} steps: "
            f"{info[f'{name}_agreement']:.3f}")
    per_round = time_rounds(steps, start, args.rounds, args.steps)
    for name in VARIANTS:
        values = per_round.get(name)
        info[f"{name}_ms_p50"] = round(statistics.median(values), 3) if values else None
        info[f"{name}_ms_min"] = round(min(values), 3) if values else None
    for name in VARIANTS[1:]:
        if info[f"{name}_ms_p50"] is not None:
            info[f"{name}_speedup_vs_eager"] = round(info["eager_ms_p50"] / info[f"{name}_ms_p50"], 2)
            if name != "compile":
                info[f"{name}_speedup_vs_compile"] = round(info["compile_ms_p50"] / info[f"{name}_ms_p50"], 2)
    return info


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.openvino_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds; each runs every variant in turn")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per variant per round")
    parser.add_argument("--check-steps", type=int, default=16, help="greedy steps compared with eager's")
    parser.add_argument("--threads", type=int, help="torch's and OpenVINO's threads (default: torch's default)")
    parser.add_argument("--models", type=Path, default=REPO / ".cache" / "test-models")
    parser.add_argument("--cache-dir", type=Path, help="inductor cache dir (default: a new empty one = cold)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "openvino_decode")
    args = parser.parse_args()
    if args.check_steps + max(len(p) for p in PROMPTS) > CACHE_LENGTH or args.steps > CACHE_LENGTH // 2:
        raise SystemExit(f"--steps and --check-steps must fit the {CACHE_LENGTH}-position cache after the prompt")
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="bench-openvino-decode-inductor-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)  # before torch imports inductor
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import openvino as _openvino  # noqa: F401 -- its version goes in the header
    import torch

    from handlers.rungs.openvino import probe_openvino
    from handlers.tasks.decoding import DecodeStep

    if args.threads:
        torch.set_num_threads(args.threads)
    openvino, reason = probe_openvino()  # telemetry off before anything converts
    if openvino is None:
        raise SystemExit(reason)
    header = run_header(args, {"inductor_cache": str(cache_dir), "openvino": openvino.__version__,
                               "cache_length": CACHE_LENGTH})
    model, tokenizer = load_model(args.models)
    eager = DecodeStep(model).eval()
    compiled = torch.compile(DecodeStep(model).eval(), backend="inductor", options={"cpp_wrapper": True},
                             dynamic=False)
    rows_out = [measure(rows, args, openvino, model, tokenizer, eager, compiled) for rows in BATCHES]

    def cell(info: dict[str, Any], name: str) -> str:
        value = info.get(f"{name}_ms_p50")
        return "failed" if value is None else f"{value:.3f}"

    table = markdown_table(
        ["batch", *[f"{name} ms/step" for name in VARIANTS], "ov_stateful vs compile", "agreement (c / ovl / ovf)"],
        [[f"b{info['batch']}", *[cell(info, name) for name in VARIANTS],
          f"{info['ov_stateful_speedup_vs_compile']:.2f}x" if "ov_stateful_speedup_vs_compile" in info else "-",
          " / ".join(f"{info[f'{name}_agreement']:.2f}" if f"{name}_agreement" in info else "-"
                     for name in VARIANTS[1:])]
         for info in rows_out])
    write_csv(args.out / "openvino_decode.csv", rows_out)
    write_json(args.out / "openvino_decode.json", {"header": header, "rows": rows_out})
    (args.out / "openvino_decode.md").write_text(f"`{header['command']}`\n\n{table}\n")
    present = [name for name in VARIANTS if any(info.get(f"{name}_ms_p50") is not None for info in rows_out)]
    write_plot(args.out / "openvino_decode.png",
               f"decode step, cache {CACHE_LENGTH}, fp32 (median over rounds)",
               [f"b{info['batch']}" for info in rows_out],
               [("ms per decode step", {name: [info.get(f"{name}_ms_p50") or 0.0 for info in rows_out]
                                         for name in present})])
    print(table)


if __name__ == "__main__":
    main()
