"""``pt2_handlers``: this package's settings. What a key may hold can depend on the task (its gate keys, float32
only, static shapes only: handlers/config/task_facts.py) and on pt2's ``dynamic`` (told through the validation context).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PlainValidator, StrictBool, StrictStr, ValidationInfo,
                      WithJsonSchema, create_model, field_validator)

from handlers.config.fields import (PositiveInt, PositiveInts, Seconds, Section, choose, did_you_mean, one_of, problem,
                                    problems, shown)
from handlers.config.shapes import AfterReady, PolicyKind, ShapePolicy
from handlers.config.image import ImageSection
from handlers.config.inputs import InputSection
from handlers.config.task_facts import IMAGE_TASK, TASK_FACTS, TASK_NAMES, USER_TASK_PATTERN, is_user_task
from handlers.config.values import Attention, DType, HandlerSettings, ModuleGuards, Pick, RungName, TooLong

DEFAULTS = HandlerSettings()
PRECISIONS = tuple(d.value for d in DType if d is not DType.AUTO)  # what a dtype list may name (and auto, last)
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


class ShapesSection(Section):
    """Which input shapes the compiled model sees, all warmed before READY, and what an unseen one gets after."""

    policy: one_of(PolicyKind) | None = None
    """`buckets`: each batch is padded up to the smallest (batch, sequence) bucket that holds it, every bucket
    compiled statically. `dynamic`: symbolic batch and sequence dimensions, one graph for every size. Left out:
    `dynamic` when `pt2.compile.dynamic: true`, else `buckets`."""
    batch_sizes: PositiveInts | None = None
    """Batch buckets (`buckets`), or the batch sizes warmed (`dynamic`: must include 1 and one >= 2). Left out:
    the task's, `[1, 2, 4]` (text-generation `[1, 4]`)."""
    seq_lengths: PositiveInts | None = None
    """Sequence buckets, capped at `max_length`, with `max_length` added as the last one (`buckets`); or the lengths
    warmed (`dynamic`). Left out: the task's, `[16, 32, 64, 128]` (text-generation: KV cache lengths, `[256]`)."""
    after_ready: one_of(AfterReady) = AfterReady.EAGER
    """A shape that would need a new compile after READY: `eager` (served eagerly, never compiled), `fail` (a 500
    naming the shape), `compile` (compiled while its request waits)."""
    seq_multiple: PositiveInt | None = None
    """`dynamic` only: each batch's sequence is padded up to a multiple of this (never past `max_length`). Left out:
    16 where oneDNN runs the matmuls and keeps a kernel per shape (bf16/fp16, int8, and fp32 compiled with `freezing:
    true`: exact lengths grew a worker by hundreds of MB), and 1 in unfrozen fp32, where MKL keeps nothing per shape."""

    length_groups: bool = True
    """Tasks that answer one row per text (embeddings, text classification): run a batch's rows in groups of similar
    length, each padded only to its own longest, where a cost model fitted at load says that is faster than one
    forward padded to the batch's longest. `false`: every batch as one padded forward."""

    small_batch_tokens: PositiveInt | None = None
    """`dynamic` only, with `freezing: true`: batches of at most this many tokens (rows x padded length, e.g. 32)
    run a second graph of each compile rung, traced at the smallest warmup shape, whose matmuls inductor picks at
    that size between its C++ GEMM template and oneDNN/MKL (`max_autotune`); larger batches run the first graph,
    as without it. MiniLM fp32 on an AVX2-only CPU: a forward of one text of 16 tokens 28 % faster, of 32 tokens
    21 %; the template is slower from 128 rows of tokens up; bf16 on an AVX-512 CPU without AMX gains nothing
    (docs/shapes.md: small batches). int8 rungs, and every rung under torch < 2.13, keep one graph. Costs a second
    compile at load and a second copy of the frozen weights. Left out: one graph for every batch."""

    @field_validator("policy")
    @classmethod
    def _policy_agrees_with_compile(cls, policy: PolicyKind, info: ValidationInfo) -> PolicyKind:
        compile_dynamic = (info.context or {}).get("compile_dynamic")
        if compile_dynamic is not None and compile_dynamic != (policy is PolicyKind.DYNAMIC):
            raise problem(f"{policy.value} contradicts pt2.compile.dynamic: {str(compile_dynamic).lower()}; drop one "
                          "of them (buckets compile static shapes, dynamic compiles symbolic ones)")
        return policy

    @field_validator("batch_sizes")
    @classmethod
    def _dynamic_warms_one_and_more(cls, sizes: list[int], info: ValidationInfo) -> list[int]:
        if "policy" not in info.data:  # the policy is wrong, and reported
            return sizes
        kind = info.data["policy"] or _implied_policy((info.context or {}).get("compile_dynamic"))
        if kind is PolicyKind.DYNAMIC and (1 not in sizes or max(sizes) < 2):
            raise problem(f"the dynamic policy warms batch size 1 and one >= 2 (torch specializes size 1), got {sizes}")
        return sizes

    @field_validator("small_batch_tokens")
    @classmethod
    def _small_batches_need_dynamic_shapes(cls, tokens: int | None, info: ValidationInfo) -> int | None:
        if tokens is None or "policy" not in info.data:
            return tokens
        kind = info.data["policy"] or _implied_policy((info.context or {}).get("compile_dynamic"))
        if kind is not PolicyKind.DYNAMIC:
            raise problem("a second graph for small batches needs the dynamic policy (buckets compile a graph per "
                          "bucket already); drop small_batch_tokens or use policy: dynamic")
        smallest = min(info.data.get("batch_sizes") or [1]) * min(info.data.get("seq_lengths") or [16])
        if tokens < smallest:
            raise problem(f"no warmup shape has at most {tokens} tokens (the smallest: {smallest}), so the small "
                          "batches' graph would be compiled on live traffic; raise it or warm a smaller shape")
        return tokens


def _implied_policy(compile_dynamic: bool | None) -> PolicyKind:
    return PolicyKind.DYNAMIC if compile_dynamic else PolicyKind.BUCKETS


def shape_policy(section: ShapesSection, defaults: ShapePolicy, compile_dynamic: bool | None) -> ShapePolicy:
    """The policy ``section`` means, with the task's buckets where it gives none and ``pt2.compile.dynamic``
    choosing the kind where it names none."""
    return ShapePolicy(kind=section.policy or _implied_policy(compile_dynamic),
                       batch_sizes=tuple(section.batch_sizes or defaults.batch_sizes),
                       seq_lengths=tuple(section.seq_lengths or defaults.seq_lengths),
                       after_ready=section.after_ready, seq_multiple=section.seq_multiple,
                       length_groups=section.length_groups, small_batch_tokens=section.small_batch_tokens or 0)


def _gate_thresholds_model() -> type[BaseModel]:
    """Every task's quality-gate keys as one model: what the JSON Schema offers under ``quality_gate`` (the task
    narrows it, see SettingsSection)."""
    fields = {}
    for gate in dict.fromkeys(gate for facts in TASK_FACTS.values() for gate in facts.gates):
        tasks = ", ".join(task.name for task in TASK_FACTS.values() if gate in task.gates)
        for key, default in zip(gate.keys, gate.defaults, strict=True):
            low, high = gate.bounds
            fields[key] = (float, Field(None, ge=low, le=high, description=f"{tasks}: {gate.describe(key)}.",
                                        json_schema_extra={"default": default}))
    return create_model("QualityGate", __base__=Section, __doc__="The task's acceptance thresholds.", **fields)


QualityGateKeys = _gate_thresholds_model()
TaskName = Annotated[str, WithJsonSchema({"type": "string", "oneOf": [
    *({"const": facts.name, "description": facts.summary} for facts in TASK_FACTS.values()),
    {"pattern": USER_TASK_PATTERN, "description": "a task of your own: module:Class, the module packed at the "
                                                  "archive's root with --extra-files (docs/tasks/your-own.md)"}]})]
DTypeInput = Annotated[one_of(DType) | Annotated[list[Literal[(*PRECISIONS, DType.AUTO.value)]], Field(min_length=1)],
                       WithJsonSchema({"anyOf": [
                           {"enum": [d.value for d in DType]},
                           {"type": "array", "items": {"enum": [*PRECISIONS, DType.AUTO.value]}, "minItems": 1,
                            "uniqueItems": True},
                       ]})]


def _check_task(name: Any) -> str:
    if not isinstance(name, str):
        raise problem(f"must be str, got {shown(name)}")
    if is_user_task(name):
        if not re.match(USER_TASK_PATTERN, name):
            raise problem(f"a task of your own is module:Class (a module at the archive's root), got {name!r}")
    elif name not in TASK_FACTS:
        raise problem(f"unknown task {name!r}{did_you_mean(name, TASK_NAMES)}; "
                      f"use one of: {', '.join(sorted(TASK_NAMES))}, or module:Class for a task of your own")
    return name


def _read_dtype(value: Any, info: ValidationInfo) -> tuple[DType, ...]:
    """One precision, ``auto``, or a list of precisions to try in order (fastest first), which ``auto`` may end
    (``[int8, auto]``: int8, then what auto picks on the hardware)."""
    if isinstance(value, str):
        precisions = (choose(DType, value, DTYPE_ALIASES),)
    elif isinstance(value, list | tuple):
        last = len(value) - 1
        wrong = [((index,), _not_in_a_list(name), name) for index, name in enumerate(value)
                 if name not in PRECISIONS and not (name == DType.AUTO.value and index == last > 0)]
        if wrong:
            raise problems(wrong)
        precisions = tuple(DType(name) for name in value)
        if not precisions or len(set(precisions)) != len(precisions):
            raise problem(f"a list names each precision once, at least one, got {list(value)!r}")
    else:
        raise problem(f"must be str or list, got {shown(value)}")
    facts = TASK_FACTS.get(info.data.get("task"))
    if facts and facts.float32_only and precisions not in ((DType.AUTO,), (DType.FLOAT32,)):
        raise problem(f"{facts.name} serves float32 ({facts.float32_only}); use auto or float32, "
                      f"got {', '.join(d.value for d in precisions)}")
    return precisions


def _not_in_a_list(name: Any) -> str:
    if name == DType.AUTO.value:
        return "auto may only end a list, after a precision: [int8, auto] tries int8, then what auto picks"
    return f"{name!r} is not a precision{_hint(name)}; a list takes some of: {', '.join(PRECISIONS)}, and auto last"


def _hint(name: Any) -> str:
    alias = DTYPE_ALIASES.get(name) if isinstance(name, str) else None
    return f" (did you mean {alias}?)" if alias else did_you_mean(name, (*PRECISIONS, DType.AUTO.value))


def _read_ladder(value: Any) -> tuple[RungName, ...]:
    if not isinstance(value, list | tuple):
        raise problem(f"must be a list, got {shown(value)}")
    allowed = [rung.value for rung in RungName]
    wrong = [((index,), f"unknown rung {name!r}{did_you_mean(name, allowed)}; use some of: {', '.join(allowed)}",
              name) for index, name in enumerate(value) if name not in allowed]
    if wrong:
        raise problems(wrong)
    rungs = [RungName(name) for name in value]
    if len(set(rungs)) != len(rungs):
        raise problem(f"each rung may appear once, got {list(value)!r}")
    if RungName.EAGER in rungs[:-1]:
        raise problem(f"eager is the last resort and must come last, got {list(value)!r}")
    if RungName.EAGER not in rungs:
        rungs.append(RungName.EAGER)  # documented: eager always ends the ladder
    return tuple(rungs)


def _read_gate(value: Any, info: ValidationInfo) -> Mapping[str, float]:
    """The task's thresholds, each in its range; unknown keys named with the task's own."""
    if not isinstance(value, Mapping):
        raise problem(f"must be a mapping, got {shown(value)}")
    task = info.data.get("task")
    facts = TASK_FACTS.get(task)
    if facts is None and not (isinstance(task, str) and is_user_task(task)):
        return MappingProxyType({})  # the task is wrong, and reported: which keys it reads is unknown
    # a task of one's own reads the keys its class declares: checked when it is imported, at load
    keys = facts.gate_keys if facts else tuple(str(key) for key in value)
    found, values = [], {}
    unknown = sorted(str(key) for key in value if key not in keys)
    if unknown:
        hints = "".join(did_you_mean(key, keys) for key in unknown)
        found.append(((), f"unknown key(s) {', '.join(unknown)}{hints}; allowed: {', '.join(keys)}", value))
    for key in keys:
        number = value.get(key)
        gate = next((gate for gate in facts.gates if key in gate.keys), None) if facts else None
        low, high = gate.bounds if gate else (float("-inf"), float("inf"))
        if number is None:
            continue
        if isinstance(number, bool) or not isinstance(number, int | float):
            found.append(((key,), f"must be a number, got {shown(number)}", number))
        elif not low <= number <= high:
            found.append(((key,), f"is {gate.what if gate else 'a number'} in [{low:g}, {high:g}], got "
                                  f"{float(number)!r}", number))
        else:
            values[key] = float(number)
    if found:
        raise problems(found)
    return MappingProxyType(values)


def _read_threads(value: Any) -> int | None:
    if value == "auto":
        return None  # the cores shared among the workers, chosen at load
    if isinstance(value, bool) or not isinstance(value, int):
        raise problem(f"must be int or 'auto', got {shown(value)}")
    if value <= 0:
        raise problem(f"must be a positive integer or 'auto', got {value!r}")
    return value


# The fields whose YAML differs from the value they hold: validated by a reader above, described by an input type.
TaskField = Annotated[str, PlainValidator(_check_task, json_schema_input_type=TaskName)]
Precisions = Annotated[tuple[DType, ...], PlainValidator(_read_dtype, json_schema_input_type=DTypeInput)]
Ladder = Annotated[tuple[RungName, ...], PlainValidator(_read_ladder, json_schema_input_type=list[RungName])]
GateThresholds = Annotated[Mapping[str, float], PlainValidator(_read_gate, json_schema_input_type=QualityGateKeys)]
Threads = Annotated[int | None, PlainValidator(_read_threads, json_schema_input_type=PositiveInt | Literal["auto"])]


def _task_rules(schema: dict[str, Any]) -> None:
    """JSON Schema for what depends on the task: its gate keys, float32 only, static shapes only."""
    rules = []
    for facts in TASK_FACTS.values():
        then: dict[str, Any] = {"quality_gate": {"propertyNames": {"enum": list(facts.gate_keys)}}}
        if facts.needs_inputs:
            then["inputs"] = {"minItems": 1}
        if facts.float32_only:
            then["dtype"] = {"anyOf": [{"enum": [DType.AUTO.value, DType.FLOAT32.value]}, {"const": ["float32"]}]}
        if facts.static_shapes_only:
            then["shapes"] = {"properties": {"policy": {"const": PolicyKind.BUCKETS.value}}}
        condition: dict[str, Any] = {"properties": {"task": {"const": facts.name}}}
        if facts.name != DEFAULTS.task:  # the default task's rules hold where no task is given too
            condition["required"] = ["task"]
        rules.append({"if": condition, "then": {"properties": then,
                                                **({"required": ["inputs"]} if facts.needs_inputs else {})}})
    schema["allOf"] = rules


class SettingsSection(Section):
    """This package's settings: the task, the model, the precisions and rungs to try, shapes, gate, limits."""

    model_config = ConfigDict(json_schema_extra=_task_rules)

    task: TaskField = DEFAULTS.task
    """Which task serves the model: one of the built-in ones, or `module:Class`, a task of your own in a module
    packed at the archive's root (`--extra-files`)."""
    model_dir: StrictStr = DEFAULTS.model_dir
    """The `save_pretrained` directory, relative to the unpacked archive; a path leading out of it (`../x`, `/etc`)
    fails the load. Not read where the archive carries `--model-file` + `--serialized-file`, or an exported
    program (`--serialized-file model.pt2`)."""
    inputs: list[InputSection] | None = Field(None, validate_default=True)
    """The model's input tensors, for the `tensor` task (required there) and tasks of your own: each one's name
    (the forward's keyword argument), dtype and shape, so requests are checked and warmup inputs made."""
    options: dict[StrictStr, Any] = Field(default_factory=dict)
    """Anything a task of your own reads (`settings.options` in its class); the built-in tasks read nothing here."""
    image: ImageSection | None = None
    """image-classification: the preprocessing (TorchServe's `image_classifier` by default: resize 256, centre crop
    224, ImageNet mean and std) and how many labels each answer holds."""
    max_length: PositiveInt | None = DEFAULTS.max_length
    """Tokens per text, special tokens included. Left out: `sentence_bert_config.json`'s, else the tokenizer's
    limit, capped at the model's positions."""
    too_long: one_of(TooLong) | None = DEFAULTS.too_long
    """A text longer than `max_length`: `reject` (a 400 naming the text and its length) or `truncate` (its first
    `max_length` tokens are read). Left out: `truncate` for embeddings, `reject` for the other tasks. Question
    answering reads long contexts in windows instead; text-generation truncates the prompt's start."""
    dtype: Precisions = Field(DEFAULTS.dtype, json_schema_extra={"default": DType.AUTO.value})
    """The precisions to try, fastest first. `auto`: `[bfloat16, float32]` on a CPU with AMX or AVX512-BF16 or a GPU
    with bf16 (`[float16, float32]` on one without), `[float32]` on other CPUs; auto's bf16 (or fp16) serves only
    where its eager forward is at least 5 % faster than fp32's on the warmup batches (some CPUs run bf16 slower than
    fp32). Or one precision (that one only), or a list of them, each once, e.g. `[bfloat16, float32]`, which `auto`
    may end: `[int8, auto]` tries int8, then what `auto` picks. `int8` (static int8 linear layers and convolutions,
    calibrated: see `int8_calibration`; compiled frozen; the linear layers that narrow and the value projections are
    measured first and stay float, whole or in their few largest input channels, where int8 would cost the answers;
    the float part runs in bf16 where bf16 is tried and passed its screen, else float32) is opt-in: never chosen by
    `auto`, and left out on a CPU without int8 dot products (VNNI or AMX), where it would not be faster. It is judged
    on the warmup batches and on held-out inputs it was not calibrated on; where it passes the gate it serves only if
    at least 5 % faster than the same rung in the next precision. The fp32 model is always loaded too: the reference
    and the eager fallback."""
    int8_calibration: StrictStr | None = DEFAULTS.int8_calibration
    """With `int8` in `dtype`: a UTF-8 text file in the archive (relative to it, e.g. `calibration.txt`, packaged
    with `--extra-files`), one text per line, like those the model will be sent; at least 4. int8 is calibrated on
    all but every 4th line and judged on those. Left out: int8 is calibrated on the warmup batches and judged also
    on texts of words sampled from the tokenizer's vocabulary (seeded)."""
    ladder: Ladder = Field(DEFAULTS.ladder, json_schema_extra={"uniqueItems": True, "minItems": 1})
    """The rungs to try, in order: `aot` (the AOTInductor package built into the archive with
    `pt2.export.aot_compile`, where its fingerprint fits the host; first whenever that is on, listed or not),
    `openvino` (the module exported with torch.export, converted and compiled by
    OpenVINO for the CPU, in bf16 by its precision hint where bf16 passed its screen, else f32; the default profile
    installs it), `compile` (what `pt2.compile` asks for), `safe_compile` (inductor, default mode, no custom options),
    `ipex` (CPU only), `eager`. `eager` always ends the ladder: left out, it is added; listed, it must be last. See
    `pick` for which proven rung serves."""
    pick: one_of(Pick) = DEFAULTS.pick
    """Which proven rung serves. `fastest`: the first rung of the ladder that passes the gate is raced against the next
    racing rung (`openvino` and `compile` race each other; `safe_compile` and `ipex` do not) on the warmup batches,
    and the later one serves only where it is at least 5 % faster; the race is kept beside the compile cache, and a
    later load on the same machine follows it without building the loser. `first`: the first rung of the ladder that
    passes the gate serves, as listed."""
    shapes: ShapesSection = Field(default_factory=ShapesSection, validate_default=True)  # checked against the task
    """The shape policy."""
    quality_gate: GateThresholds = Field(default_factory=lambda: MappingProxyType({}),
                                         json_schema_extra={"default": {}})
    """Thresholds a rung must meet against fp32 eager on the warmup batches to be accepted; each task reads its own
    keys (one per precision family), the others are unknown keys."""
    freezing: StrictBool = DEFAULTS.freezing
    """Inductor freezing (weights as constants, prepacked): on CPU, bf16 forwards 16-30 % faster (fp32 14-45 %), but a
    warm start takes longer, as each worker traces and folds its weights again (docs/performance.md). Off unless the
    model YAML asks; the shipped embeddings YAMLs ask."""
    attention: one_of(Attention) = DEFAULTS.attention
    """The attention of the graphs the compile rungs trace. `auto`: on a CPU with AVX-512, non-causal attention
    (embeddings, classification, token classification, question answering) runs pt2-handlers' fused kernel, built
    with the machine's C++ compiler at the first load (~10 s, kept beside the compile cache); it takes a whole
    head at once where PyTorch's CPU attention makes two small matrix calls per 32 queries (MiniLM's int8
    archive: 5-25 % more requests per second at 16 clients), on AMX tiles where the CPU has them (describe's
    `optimization.attention.instructions`). Elsewhere, and where it does not build: SDPA. Each
    rung that uses it passes the quality gate against fp32 eager, which runs SDPA. `sdpa`: SDPA everywhere, as the
    model comes."""
    module_guards: one_of(ModuleGuards) = DEFAULTS.module_guards
    """Dynamo's guards on the model's attributes (each layer norm's `eps`, each module's type and hooks), checked by
    every compiled forward. `auto`: left out of compiles that freeze the weights (`freezing: true`, and int8) where
    the model's attributes, and its config's, are the same after the last of the ladder's fp32 reference forwards as
    after the first (a forward that changes any, such as a call counter, keeps them all); describe's
    `optimization.module_guards` says which and why (torch < 2.13, as in the ipex profile, keeps them all). MiniLM
    on an AVX2-only CPU: 0.5-0.8 ms off a forward of one short text. Code of your own that changes the served model's
    attributes between requests would go unseen by its compiled graph: `keep` keeps every guard."""
    threads: Threads = Field(DEFAULTS.threads, json_schema_extra={"default": "auto"})
    """Intra-op threads per worker. `auto`: `OMP_NUM_THREADS` where a launcher set it (fixed); else the workers on the
    usable cores (CPU affinity, capped by the container's CPU limit) share them forward by forward: a forward runs on
    every core while no other worker holds a batch, on an equal share while others do (or did at once in the last
    0.1 s), and waits rather than oversubscribe them (the workers on the cores load in turn, each on every core; its
    compiled forward is proven at every core and at half of them, with the same graphs where inductor compiles it).
    A number: that many threads for every forward, shared with no one."""
    compile_cache: StrictStr | None = DEFAULTS.compile_cache
    """Where inductor keeps compiled graphs and kernels. Left out: `TORCHINDUCTOR_CACHE_DIR`, else torch's default.
    An unusable directory is replaced by a private one, with a warning."""
    compile_artifacts: StrictBool = DEFAULTS.compile_artifacts
    """Carry the compile cache in the archive: `python -m handlers package` loads the model as a worker does (the
    whole ladder, in a process of its own, from an empty compile cache) and keeps what it compiled and measured:
    torch's cache artifacts (`torch.compiler.save_cache_artifacts`: graphs and kernels), the OpenVINO rung's IR and
    compiled blobs, the fused attention kernel, the races. A worker whose host fits the packaging host (same torch,
    same device, a CPU whose kernels may use every instruction set the packaging host's could) loads them before its
    ladder, so its compile rungs skip inductor's code generation and its openvino rung the conversion; elsewhere they
    are left out, with the reason in describe (`compile_cache.archive_artifacts`)."""
    max_runtime_failures: PositiveInt = DEFAULTS.max_runtime_failures
    """Failed optimized forwards on live batches before the worker demotes itself to fp32 eager."""
    max_inputs_per_request: PositiveInt = DEFAULTS.max_inputs_per_request
    """Texts per request (question answering: context windows); more gets a 400."""
    batch_metrics_every_s: Seconds = DEFAULTS.batch_metrics_every_s
    """How often a worker emits its per-batch gauges (`Pt2StageMilliseconds`, `Pt2BatchRequests`,
    `Pt2ForwardThreads`, `Pt2PaddingPercent`): its first batch's at once, then, with the first batch at least this
    many seconds after the last emission, the means of the batches since. A Prometheus scrape reads only a gauge's
    latest value; emitting eight gauges every batch cost a lone short request 0.5-1.3 ms of the worker's time on a
    2-core AVX2 CPU. `0`: every batch's own values."""

    @field_validator("freezing")
    @classmethod
    def _small_batches_need_freezing(cls, freezing: bool, info: ValidationInfo) -> bool:
        shapes = info.data.get("shapes")
        if shapes is not None and shapes.small_batch_tokens and not freezing:
            raise problem("shapes.small_batch_tokens needs freezing: true (inductor's C++ GEMM template, which the "
                          "small batches' graph is for, takes constant weights only)")
        return freezing

    @field_validator("inputs")
    @classmethod
    def _inputs_named_once(cls, inputs: list[InputSection] | None, info: ValidationInfo) -> list[InputSection] | None:
        names = [section.name for section in inputs or ()]
        if len(set(names)) != len(names):
            raise problem(f"each input is named once, got {names}")
        facts = TASK_FACTS.get(info.data.get("task"))
        if facts and facts.needs_inputs and not inputs:
            raise problem(f"the {facts.name} task needs the model's inputs: a list of {{name, dtype, shape}}, e.g. "
                          "[{name: x, dtype: float32, shape: [batch, 16]}]")
        if facts and inputs and not facts.needs_inputs:
            raise problem(f"{facts.name} reads text through its tokenizer: inputs are for the tensor task and tasks "
                          "of your own")
        return inputs

    @field_validator("image")
    @classmethod
    def _image_task_only(cls, image: ImageSection | None, info: ValidationInfo) -> ImageSection | None:
        task = info.data.get("task")
        if image is not None and task in TASK_FACTS and task != IMAGE_TASK:
            raise problem(f"image is read by the {IMAGE_TASK} task (and tasks of your own), not {task}")
        return image

    @field_validator("int8_calibration")
    @classmethod
    def _only_with_int8(cls, path: str | None, info: ValidationInfo) -> str | None:
        dtype = info.data.get("dtype")
        if path is not None and dtype is not None and DType.INT8 not in dtype:
            raise problem(f"only int8 is calibrated, and dtype [{', '.join(d.value for d in dtype)}] has no int8; "
                          "add int8 to dtype (e.g. [int8, auto]) or drop int8_calibration")
        return path

    @field_validator("shapes")
    @classmethod
    def _shapes_suit_the_task(cls, shapes: ShapesSection, info: ValidationInfo) -> ShapesSection:
        facts = TASK_FACTS.get(info.data.get("task"))
        kind = shapes.policy or _implied_policy((info.context or {}).get("compile_dynamic"))
        if facts and facts.static_shapes_only and kind is PolicyKind.DYNAMIC:
            raise problem(f"{facts.name} compiles static shapes only ({facts.static_shapes_only}); use policy: "
                          "buckets and leave pt2.compile.dynamic unset")
        return shapes


def read_settings(value: Any, _handler: Any, info: ValidationInfo) -> SettingsSection:
    return SettingsSection.model_validate(value, context=info.context)  # pt2's dynamic: see validate_model_yaml
