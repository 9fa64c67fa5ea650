"""The documentation cannot drift from what the code does.

- Every ```console block in README.md and docs/ is run against a real TorchServe on loopback (token auth on), and
  what each ``$ command`` prints is compared with the output the block shows under it. The convention is in
  docs/contributing.md: JSON is compared structurally (same keys, same types, strings and integers equal, floats
  within a tolerance), ``...`` stands for "any value" or "more elements", text is compared line by line.
- No other shell block claims an output (a ``$ `` prompt outside a console block would go untested).
- Every link from README.md into docs/ names a file that exists.
- ``mkdocs build --strict`` passes (scripts/test.sh builds the site too, before the pytest stages).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from handlers.serving import server as tsctl
from tests.conftest import port_shift

REPO = Path(__file__).resolve().parent.parent

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PORT_SHIFT = port_shift(16000)  # clear of the other test servers (+10000 ... +15000)
# The names the docs call, and the archives tests/conftest.py's model_store builds for them.
SERVED = {"minilm": "minilm.mar", "sentiment": "minilm-sentiment.mar", "ner": "minilm-ner.mar", "qa": "minilm-qa.mar",
          "llama": "tiny-llama.mar", "ranker": "ranker.mar", "ranker-exported": "ranker-exported.mar",
          "ranking": "ranking.mar"}
# Pages whose examples are the point of the page: each must have at least one executed block.
MUST_RUN = ["README.md", "docs/getting-started.md", "docs/tasks/embeddings.md", "docs/tasks/text-classification.md",
            "docs/tasks/token-classification.md", "docs/tasks/question-answering.md",
            "docs/tasks/text-generation.md", "docs/tasks/errors.md", "docs/operations.md", "docs/open-inference.md",
            "docs/configuration.md", "docs/tasks/your-own.md"]
DEFAULT_TOLERANCE = 0.02  # a half-precision rung may differ from fp32 by the gate's 1e-2; CI may run either
ANY = "\u2026docs-test-any"  # what ``...`` in expected JSON becomes: any value, more elements, more keys
MARK = "\u2026docs-test-rc"
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
OPTIONS = re.compile(r"^\s*<!--\s*docs-test:(?P<options>.*?)-->\s*$")


@dataclass(frozen=True)
class Command:
    text: str
    expected: list[str]
    line: int


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    info: str
    body: list[str]
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a markdown file, with its info string and the docs-test options written in an
    HTML comment on the last non-blank line before it."""
    lines = path.read_text().splitlines()
    blocks, index, previous = [], 0, ""
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            if lines[index].strip():
                previous = lines[index]
            index += 1
            continue
        indent, fence = len(match["indent"]), match["fence"]
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        options = OPTIONS.match(previous)
        blocks.append(Block(path, index + 1, match["info"], [line[indent:] for line in lines[index + 1:end]],
                            parse_options(options["options"]) if options else {}))
        index, previous = end + 1, ""
    return blocks


def parse_options(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split())


def commands(block: Block) -> list[Command]:
    """``$ `` lines (continued by a trailing backslash) and the output lines under each."""
    parsed: list[Command] = []
    lines = block.body
    index = 0
    while index < len(lines):
        if not lines[index].startswith("$ "):
            raise AssertionError(f"{block.where}: a console block starts with a `$ ` command, not {lines[index]!r}")
        start = index
        text = [lines[index][2:]]
        while text[-1].endswith("\\") and index + 1 < len(lines):
            index += 1
            text.append(lines[index])
        index += 1
        output = []
        while index < len(lines) and not lines[index].startswith("$ "):
            output.append(lines[index])
            index += 1
        parsed.append(Command("\n".join(text), output, block.line + 1 + start))
    return parsed


def console_blocks() -> list[Block]:
    return [block for path in DOC_FILES for block in fenced_blocks(path) if block.info == "console"]


# --- comparing what a command printed with what the docs show ---

def with_ellipses(text: str) -> str:
    """JSON with ``...`` outside strings replaced by ANY: a value (``"seed": ...``), a last list element
    (``[0.1, ...]``) or an object member (``{"a": 1, ...}``)."""
    out, stack, index, in_string = [], [], 0, False
    while index < len(text):
        char = text[index]
        if in_string:
            escaped = text[index:index + 2] if char == "\\" else char
            in_string = char != '"'
            out.append(escaped)
            index += len(escaped)
            continue
        if text.startswith("...", index):
            member = stack[-1:] == ["{"] and "".join(out).rstrip()[-1:] in ("{", ",")
            out.append(f'"{ANY}": null' if member else f'"{ANY}"')
            index += 3
            continue
        in_string = char == '"'
        if char in "{[":
            stack.append(char)
        elif char in "}]" and stack:
            stack.pop()
        out.append(char)
        index += 1
    return "".join(out)


def expected_json(lines: list[str]) -> list | None:
    """The expected output as JSON documents: one for the whole output, else one per line, else None (text)."""
    text = "\n".join(lines).strip()
    try:
        return [json.loads(with_ellipses(text))]
    except ValueError:
        pass
    try:
        return [json.loads(with_ellipses(line)) for line in lines if line.strip()]
    except ValueError:
        return None


def compare(want, got, where: str, tolerance: float) -> list[str]:
    """Differences between expected and actual JSON: keys, types, lengths, values (floats within ``tolerance``)."""
    if want == ANY:
        return []
    if isinstance(want, dict):
        return compare_objects(want, got, where, tolerance)
    if isinstance(want, list):
        return compare_lists(want, got, where, tolerance)
    if isinstance(want, float) and not isinstance(want, bool):
        close = isinstance(got, (int, float)) and not isinstance(got, bool) and abs(got - want) <= tolerance
        return [] if close else [f"{where}: {got!r}, the docs show {want!r} (tolerance {tolerance})"]
    if type(got) is not type(want) or got != want:
        return [f"{where}: {got!r}, the docs show {want!r}"]
    return []


def compare_objects(want: dict, got, where: str, tolerance: float) -> list[str]:
    if not isinstance(got, dict):
        return [f"{where}: {type(got).__name__} {got!r:.80}, the docs show an object"]
    keys = set(want) - {ANY}
    problems = [f"{where}: no key {key!r}, which the docs show" for key in sorted(keys - set(got))]
    if ANY not in want:
        problems += [f"{where}: key {key!r} is not in the docs" for key in sorted(set(got) - keys)]
    for key in sorted(keys & set(got)):
        problems += compare(want[key], got[key], f"{where}.{key}", tolerance)
    return problems


def compare_lists(want: list, got, where: str, tolerance: float) -> list[str]:
    if not isinstance(got, list):
        return [f"{where}: {type(got).__name__} {got!r:.80}, the docs show a list"]
    more = bool(want) and want[-1] == ANY
    shown = want[:-1] if more else want
    if len(got) < len(shown) or (not more and len(got) != len(shown)):
        return [f"{where}: {len(got)} elements, the docs show {len(shown)}{' or more' if more else ''}"]
    problems = []
    for index, (wanted, value) in enumerate(zip(shown, got, strict=False)):
        problems += compare(wanted, value, f"{where}[{index}]", tolerance)
    return problems


def compare_text(want: list[str], got: str) -> list[str]:
    """Line by line; ``...`` in a line matches any text, a line of only ``...`` any number of lines."""
    pattern = "".join(r"(?:[^\n]*\n)*?" if line.strip() == "..." else
                      ".*?".join(re.escape(part) for part in line.rstrip().split("...")) + "\n"
                      for line in trim(want))
    text = "".join(line + "\n" for line in trim(got.splitlines()))
    return [] if re.fullmatch(pattern, text) else ["the output differs from the docs"]


def trim(lines: list[str]) -> list[str]:
    lines = [line.rstrip() for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def check_output(command: Command, output: str, tolerance: float) -> list[str]:
    want = expected_json(command.expected)
    if want is None or not command.expected:
        return compare_text(command.expected, output)
    try:
        got = [json.loads(output)] if len(want) == 1 else [json.loads(line) for line in output.splitlines()
                                                            if line.strip()]
    except ValueError:
        return ["the docs show JSON; the command printed something else"]
    if len(got) != len(want):
        return [f"{len(got)} JSON lines, the docs show {len(want)}"]
    return [problem for index, (wanted, value) in enumerate(zip(want, got, strict=True))
            for problem in compare(wanted, value, f"line {index + 1}" if len(want) > 1 else "$", tolerance)]


# --- running a block ---

@dataclass(frozen=True)
class Target:
    """Where the docs' commands run: a working directory, an environment, and text substitutions that point the
    shipped addresses and scripts at the test's server."""
    cwd: Path
    env: dict[str, str]
    substitutions: dict[str, str]


def run_block(block: Block, target: Target) -> list[str]:
    """Run the block's commands in one bash (so ``$ echo $?`` reads the previous status); return the problems."""
    parsed = commands(block)
    script = ["exec 2>&1"]
    for index, command in enumerate(parsed):
        text = command.text
        for old, new in target.substitutions.items():
            text = text.replace(old, new)
        script += [text, f'__rc=$?; printf "\\n{MARK} {index} %s\\n" "$__rc"; (exit $__rc)']
    result = subprocess.run(["bash", "-c", "\n".join(script)], cwd=target.cwd, env=target.env, capture_output=True,
                            text=True, timeout=300)
    pieces = re.split(rf"\n{MARK} (\d+) (\d+)\n", result.stdout)
    outputs, statuses = pieces[0:-1:3], [int(status) for status in pieces[2::3]]
    if len(statuses) != len(parsed):
        return [f"{block.where}: the block stopped after {len(statuses)} of {len(parsed)} commands:\n{result.stdout}"]
    tolerance = float(block.options.get("tolerance", DEFAULT_TOLERANCE))
    problems = []
    for index, command in enumerate(parsed):
        claims_status = index + 1 < len(parsed) and parsed[index + 1].text.strip() == "echo $?"
        found = [] if statuses[index] == 0 or claims_status else [f"exit status {statuses[index]}"]
        found += check_output(command, outputs[index], tolerance)
        if found:
            problems.append(f"{block.path.relative_to(REPO)}:{command.line}: $ {command.text}\n  "
                            + "\n  ".join(found) + f"\n  printed:\n{outputs[index]}")
    return problems


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory, model_store):
    """One TorchServe serving every model the docs call, under the names they use."""
    tmp = tmp_path_factory.mktemp("docs-torchserve")
    started = time.monotonic()
    server = tsctl.start(tsctl.shifted_config(tmp, PORT_SHIFT), model_store,
                         [f"{name}={archive}" for name, archive in SERVED.items()], tmp / "run", timeout=900)
    print(f"TorchServe READY with {', '.join(SERVED)} in {time.monotonic() - started:.0f}s")
    yield server
    tsctl.stop(server.run_dir)


@pytest.fixture(scope="module")
def target(docs_server, tmp_path_factory) -> Target:
    assert shutil.which("curl"), "the docs' examples call curl: install it (apt-get install curl)"
    cwd = tmp_path_factory.mktemp("docs-cwd")  # files the examples write stay out of the checkout
    for entry in REPO.iterdir():
        if entry.name in ("handlers", "benchmarks", "model_configs", "scripts", "deploy", "schema", "constraints"):
            (cwd / entry.name).symlink_to(entry)
    (cwd / ".venv").symlink_to(Path(sys.prefix))
    config = docs_server.run_dir.parent / "config.properties"
    server_args = f"--config {config} --run-dir {docs_server.run_dir}"
    substitutions = {"http://127.0.0.1:8080": docs_server.inference_url,
                     "http://127.0.0.1:8081": docs_server.management_url,
                     "http://127.0.0.1:8082": docs_server.metrics_url,
                     **{command: f"{command} {server_args}"
                        for command in ("-m handlers", "-m benchmarks.grpc_client", "scripts/sample_request.py")}}
    env = {**os.environ, "KEY": docs_server.key("inference"), "MKEY": docs_server.key("management")}
    env.pop("PYTHONPATH", None)
    return Target(cwd, env, substitutions)


def blocks_by_file() -> dict[str, list[Block]]:
    found: dict[str, list[Block]] = {}
    for block in console_blocks():
        found.setdefault(str(block.path.relative_to(REPO)), []).append(block)
    return found


@pytest.mark.integration
@pytest.mark.default_profile
@pytest.mark.parametrize("page", sorted(blocks_by_file()))
def test_every_console_example_prints_what_the_docs_show(page, target):
    problems = [problem for block in blocks_by_file()[page] for problem in run_block(block, target)]
    assert not problems, "\n\n".join(problems)


def test_the_pages_about_requests_have_examples_that_run():
    have = blocks_by_file()
    missing = [page for page in MUST_RUN if not any(commands(block) for block in have.get(page, []))]
    assert not missing, f"no executed ```console example in {missing}"


def test_no_other_code_block_claims_an_output():
    """A ``$ `` prompt means "this prints that": outside a console block it would never be run."""
    claims = [block.where for path in DOC_FILES for block in fenced_blocks(path)
              if block.info != "console" and any(line.startswith("$ ") for line in block.body)]
    assert not claims, f"make these ```console blocks (run by this test), or drop the `$ ` prompts: {claims}"


# --- the parts of the convention that could fail silently are pinned here ---

def test_the_comparison_catches_what_it_should():
    want = json.loads(with_ellipses('{"label": "a", "score": 0.5, "vector": [0.1, 0.2, ...], "seed": ..., ...}'))
    assert json.loads(with_ellipses('[{"a": [...], ...}, ...]')) == [{"a": [ANY], ANY: None}, ANY]
    assert compare(want, {"label": "a", "score": 0.51, "vector": [0.1, 0.2, 0.3], "seed": 7, "x": 1}, "$", 0.02) == []
    assert compare(want, {"label": "b", "score": 0.5, "vector": [0.1, 0.2], "seed": None}, "$", 0.02) == [
        "$.label: 'b', the docs show 'a'"]
    assert compare(want, {"label": "a", "score": 0.6, "vector": [0.1], "seed": 1}, "$", 0.02) == [
        "$.score: 0.6, the docs show 0.5 (tolerance 0.02)", "$.vector: 1 elements, the docs show 2 or more"]
    closed = json.loads(with_ellipses('{"n": 1, "ok": true, "s": "x..."}'))
    assert compare(closed, {"n": 1.0, "ok": 1, "s": "x...", "extra": 0}, "$", 0.02) == [
        "$: key 'extra' is not in the docs", "$.n: 1.0, the docs show 1", "$.ok: 1, the docs show True"]
    assert compare_text(["a ...", "...", "z"], "a b c\nm\nn\nz\n") == []
    assert compare_text(["a ...", "z"], "a b\nm\nz\n") == ["the output differs from the docs"]


def test_the_bad_request_table_is_what_hostile_inputs_prints():
    """docs/tasks/errors.md shows the cases' table verbatim; tests/test_torchserve.py checks the cases on a real
    TorchServe for every task."""
    printed = subprocess.run([sys.executable, "-m", "benchmarks.hostile_inputs", "--markdown"], cwd=REPO,
                             capture_output=True, text=True, check=True, timeout=120).stdout.strip().splitlines()
    page = (REPO / "docs" / "tasks" / "errors.md").read_text().splitlines()
    assert printed and printed[0] in page, "no table from python -m benchmarks.hostile_inputs --markdown on the page"
    start = page.index(printed[0])
    shown = page[start:start + len(printed) + 1]
    ends = len(shown) == len(printed) or not shown[-1].startswith("|")
    assert shown[:len(printed)] == printed and ends, (
        "docs/tasks/errors.md's table differs from python -m benchmarks.hostile_inputs --markdown: paste its output")


def test_readme_links_into_docs_resolve():
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert len(links) >= 8, f"the README links into docs/ only {len(links)} times"
    missing = [path for path, _ in links if not (REPO / path).is_file()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    broken = [f"{path}#{anchor}" for path, anchor in links if anchor and anchor not in heading_ids(REPO / path)]
    assert not broken, f"README.md links to headings that do not exist: {broken}"


def heading_ids(path: Path) -> set[str]:
    """The anchors of a page's headings, as Python-Markdown's toc (and GitHub, for these) writes them."""
    headings = [line.lstrip("#").strip() for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower()) for heading in headings}


@pytest.mark.default_profile
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    assert mkdocs.is_file(), "mkdocs is not installed in this venv: bash scripts/setup.sh installs it"
    result = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
