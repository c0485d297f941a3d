"""README.md's code works on a fresh clone (issue 42).

- ```python blocks compile; a self-contained one (no name it does not define) runs, on the CPU;
  every ``autopart.<name>`` is public API (``autopart.__all__``), every keyword of a call to
  ``autopart.compile`` / ``plan_model`` / ``load`` / ``CompileOptions``, ``pipe.<method>`` and
  ``profile.solve`` is one they take, and every ``pipe.<attr>`` / ``profile.<attr>`` exists.
- ```bash blocks and inline commands: ``autopart <command> --flag`` names a real command and
  flags it accepts, ``make <target>`` a Makefile target, ``<script>.py --flag`` a script that
  exists and a flag its argparse parser defines; a lone inline ``--flag`` is one of those.
- Every relative link and every repository path in inline code points at a file that exists.
- ``make demo`` and ``make test`` are the first two commands.

``test_a_mistake_is_caught`` feeds each check a README with one mistake in it, so a check that
silently stopped checking fails too.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import inspect
import re
import shlex
import symtable
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import typer.main

import autopart
from autopart.apps.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MAX_LINES = 260  # issue 42: "at most ~250"; dated measurements belong in docs/measurements.md
# repository folders an inline path may point into (other paths are outputs: runs/, out/, ...)
REPO_DIRS = ("benchmarks", "docs", "examples")
FILE_SUFFIXES = {"json", "py", "md", "txt", "toml", "yaml", "png", "jsonl"}


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                    re.M | re.S)


def fenced_blocks(text: str) -> list[Block]:
    return [Block(m["lang"], textwrap.dedent(m["body"]), text.count("\n", 0, m.start()) + 1)
            for m in _FENCE.finditer(text)]


def prose(text: str) -> str:
    """The README without its fenced blocks."""
    return _FENCE.sub("", text)


def inline_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


# ---- Python ----------------------------------------------------------------------------------
def free_names(src: str) -> set[str]:
    """Names the code reads but neither defines, imports nor gets from builtins."""
    top = symtable.symtable(src, "README", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    free: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            global_read = sym.is_referenced() and (table is top or sym.is_global())
            if global_read and sym.get_name() not in defined:
                free.add(sym.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return free - set(dir(builtins))


def _accepts(fn: Callable[..., Any], keyword: str) -> bool:
    """Whether ``fn`` takes ``keyword``. compile, load and Profile.solve hand their
    ``**kwargs`` on to ``CompileOptions``/``compile``, so they take only those names; any
    other ``**kwargs`` (``train_step``'s model keywords) takes every name."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    named = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if keyword in named:
        return True
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return False
    if fn not in (autopart.compile, autopart.load, autopart.Profile.solve):
        return True
    return keyword in {f.name for f in dataclasses.fields(autopart.CompileOptions)} \
        or keyword in inspect.signature(autopart.compile).parameters


def pipeline_types() -> tuple[Any, ...]:
    """What ``pipe`` is in the README: any public pipeline class, and a namespace of the
    attributes their code sets on ``self`` (``plan``, ``timings_s``, ...)."""
    classes = (autopart.Pipeline, autopart.PipelinedModule, autopart.DistributedPipeline,
               autopart.LazyPipeline)
    assigned: set[str] = set()
    for klass in {k for cls in classes for k in cls.__mro__ if k.__module__.startswith("autopart")}:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        assigned |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                     and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                     and n.value.id == "self"}
    return (*classes, SimpleNamespace(**dict.fromkeys(assigned)))


def api_problems(tree: ast.AST, where: str, pipes: Iterable[Any], *, bare: bool = False) -> list[str]:
    """``autopart.<name>``, ``pipe.<attr>`` and ``profile.<attr>`` exist, and the keywords of
    calls to them are accepted; with ``bare`` (inline prose), so are those of bare calls the
    prose names by their short name (``plan_model(..., cache=False)``, ``train_step(...)``)."""
    receivers: dict[str, tuple[Any, ...]] = {"autopart": (autopart,), "pipe": tuple(pipes),
                                             "profile": (autopart.Profile,)}
    problems = []

    def resolve(node: ast.AST) -> list[Any] | None:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in receivers:
            owners = receivers[node.value.id]
            if node.value.id == "autopart" and node.attr not in autopart.__all__:
                problems.append(f"{where}: autopart.{node.attr} is not in autopart.__all__")
                return None
            found = [getattr(o, node.attr) for o in owners if hasattr(o, node.attr)]
            if not found:
                problems.append(f"{where}: {node.value.id}.{node.attr} does not exist")
            return found
        if bare and isinstance(node, ast.Name):
            if node.id in autopart.__all__:
                return [getattr(autopart, node.id)]
            return [getattr(p, node.id) for p in receivers["pipe"] if hasattr(p, node.id)] or None
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            resolve(node)
        elif isinstance(node, ast.Call):
            targets = resolve(node.func)
            for kw in node.keywords:
                if targets and kw.arg is not None and not any(_accepts(t, kw.arg) for t in targets):
                    problems.append(f"{where}: {ast.unparse(node.func)}() takes no {kw.arg}=")
    return sorted(set(problems))


def python_problems(text: str, pipes: Iterable[Any]) -> list[str]:
    """Every python block compiles and names real API; so do inline spans that are Python."""
    pipes = tuple(pipes)
    problems = []
    for block in fenced_blocks(text):
        if block.lang != "python":
            continue
        try:
            compile(block.code, block.where, "exec")
        except SyntaxError as exc:
            problems.append(f"{block.where}: {exc}")
            continue
        problems += api_problems(ast.parse(block.code), block.where, pipes)
    for span in inline_spans(text):
        for name in re.findall(r"\bautopart\.([A-Za-z_]\w*)", span):
            if name not in FILE_SUFFIXES and name not in autopart.__all__:
                problems.append(f"README.md `{span}`: autopart.{name} is not in autopart.__all__")
        try:
            tree = ast.parse(span, mode="eval")
        except SyntaxError:
            continue
        problems += api_problems(tree, f"README.md `{span}`", pipes, bare=True)
    return problems


# ---- commands --------------------------------------------------------------------------------
def cli_options() -> dict[str, set[str]]:
    """``{command: its flags}`` from the CLI's click group ("" for ``autopart`` itself)."""
    group = typer.main.get_command(app)

    def flags(cmd: Any) -> set[str]:
        return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)
                if o.startswith("-")} | {"--help"}
    options = {name: flags(cmd) for name, cmd in group.commands.items()}  # type: ignore[attr-defined]
    options[""] = flags(group)
    return options


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return {t for line in re.findall(r"^([A-Za-z0-9_. -]+?)\s*:(?!=)", text, re.M)
            for t in line.split() if not t.startswith(".")}


def script_flags(path: Path) -> set[str]:
    """The option strings of every ``add_argument`` call in a script."""
    flags = {"--help", "-h"}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "add_argument":
            flags |= {a.value for a in node.args
                      if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")}
    return flags


def shell_commands(code: str) -> list[list[str]]:
    """Each command of a bash block as its words: continuations joined, comments dropped, split at
    ``&&``, ``||``, ``;`` and ``|``, the ``[...]`` of optional parts taken off, env settings skipped."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        words: list[str] = []
        for word in shlex.split(line, comments=True) + [";"]:
            if word in ("&&", "||", ";", "|"):
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                    words.pop(0)
                if words:
                    commands.append(words)
                words = []
            else:  # `[--flag VALUE]`: an optional part, shown in brackets
                word = word.lstrip("[")
                while word.endswith("]") and word.count("]") > word.count("["):
                    word = word[:-1]
                if word:
                    words.append(word)
    return commands


def command_problems(words: list[str], where: str, options: dict[str, set[str]],
                     targets: set[str]) -> list[str]:
    program = Path(words[0]).name
    shown = " ".join(words)
    if program == "autopart":
        positional = [w for w in words[1:] if not w.startswith("-")]
        command = positional[0] if positional and words[1] == positional[0] else ""
        if command and command not in options:
            return [f"{where}: `{shown}`: autopart has no command {command!r}"]
        name = " ".join(("autopart", command)).strip()
        return [f"{where}: `{shown}`: {name} has no option {flag}"
                for flag in (w.split("=")[0] for w in words[1:] if w.startswith("-"))
                if flag not in options[command]]
    if program == "make":
        return [f"{where}: `{shown}`: the Makefile has no target {w!r}" for w in words[1:]
                if not w.startswith("-") and "=" not in w and w not in targets]
    scripts = [i for i, w in enumerate(words) if re.fullmatch(r"[\w./-]+\.(py|sh)", w)]
    if program in ("python", "python3", "torchrun", "bash") and scripts:
        i = scripts[0]
        path = ROOT / words[i]
        if not path.is_file():
            return [f"{where}: `{shown}`: {words[i]} does not exist"]
        if path.suffix == ".py":
            known = script_flags(path)
            return [f"{where}: `{shown}`: {words[i]} has no option {flag}"
                    for flag in (w.split("=")[0] for w in words[i + 1:] if w.startswith("--"))
                    if flag not in known]
    return []


def shell_problems(text: str) -> list[str]:
    options, targets = cli_options(), makefile_targets()
    problems = []
    for block in fenced_blocks(text):
        if block.lang in ("bash", "sh", "shell", "console"):
            for words in shell_commands(block.code):
                problems += command_problems(words, block.where, options, targets)
    scripts = {s for s in re.findall(r"\bexamples/\w+\.py\b", text) if (ROOT / s).is_file()}
    known_flags = set().union(*options.values(), *(script_flags(ROOT / s) for s in scripts))
    for span in inline_spans(text):
        if re.match(r"(\.venv/bin/)?(autopart|make) ", span):
            problems += command_problems(shlex.split(span), f"README.md `{span}`", options, targets)
        if span.startswith("--"):
            flag = span.split()[0].split("=")[0]
            if flag not in known_flags:
                problems.append(f"README.md `{span}`: no autopart command or README script "
                                f"takes {flag}")
    return problems


def first_commands(text: str, n: int = 2) -> list[str]:
    blocks = fenced_blocks(text)
    return [" ".join(w) for w in shell_commands(blocks[0].code)][:n] if blocks else []


# ---- links and paths -------------------------------------------------------------------------
def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(text: str) -> list[str]:
    body = re.sub(r"`[^`\n]*`", "", prose(text))
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", prose(text), re.M)}
    problems = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", body):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors:
                problems.append(f"README.md: link {target} names no heading")
        elif not (ROOT / path).exists():
            problems.append(f"README.md: link {target} points at no file")
    for span in inline_spans(text):
        for word in span.split():
            if re.fullmatch(r"[\w.-]+(/[\w.-]+)+/?", word) and word.split("/")[0] in REPO_DIRS \
                    and not (ROOT / word).exists():
                problems.append(f"README.md `{span}`: {word} does not exist")
    return problems


def static_problems(text: str) -> list[str]:
    return shell_problems(text) + link_problems(text) + python_problems(text, pipeline_types())


# ---- tests -----------------------------------------------------------------------------------
def test_make_demo_and_make_test_come_first() -> None:
    assert first_commands(README) == ["make demo", "make test"]
    assert fenced_blocks(README)[0].lang == "bash"


def test_commands_flags_targets_and_scripts_exist() -> None:
    assert shell_problems(README) == []


def test_links_and_paths_exist() -> None:
    assert link_problems(README) == []


def test_short_and_pointing_at_the_details() -> None:
    lines = README.count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; move details to docs/measurements.md"
    links = re.findall(r"\]\(([^)\s#]+)", prose(README))
    assert links.count("docs/measurements.md") == 1 and links.count("docs/design.md") == 1, links
    assert "benchmarks/REPORT.md" in links and "benchmarks/figures/pipeline_cpu.png" in links
    assert "autopart/" not in README, "the README names public API and commands, not files"


def test_python_blocks_run_and_name_public_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Self-contained blocks run (in a scratch folder, on the CPU, without the profile cache);
    every block and inline Python span then names only real API, ``pipe`` checked against the
    pipeline a block built as well as the classes."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOPART_CACHE", "0")
    monkeypatch.setenv("AUTOPART_PROGRESS", "0")
    python = [b for b in fenced_blocks(README) if b.lang == "python"]
    assert python, "no python blocks"
    runnable = [b for b in python if not free_names(b.code)]
    assert runnable, "no self-contained python block to run"
    # `autopart profile file.py:function` in the README calls function() from a block headed `# file.py`
    entry_points = re.findall(r"\b([\w-]+\.py):(\w+)", README)
    pipes: list[Any] = []
    for block in runnable:
        namespace: dict[str, Any] = {"__name__": "__readme__"}
        exec(compile(block.code, block.where, "exec"), namespace)
        if isinstance(namespace.get("pipe"), autopart.Pipeline):
            pipes.append(namespace["pipe"])
        header = block.code.lstrip().splitlines()[0]
        for file, function in entry_points:
            if header == f"# {file}":
                model, example_inputs = namespace[function]()
                assert isinstance(model, torch.nn.Module), (file, function)
                assert isinstance(example_inputs, tuple), (file, function)
    assert pipes, "no runnable block built a pipeline named pipe"
    assert python_problems(README, (*pipeline_types(), *pipes)) == []


MISTAKES = [  # (what the README says, the mistake, what the check must report)
    ("--cluster h100:8", "--clustr h100:8", "has no option --clustr"),
    ("autopart show gpt2", "autopart shw gpt2", "has no command 'shw'"),
    ("make test ", "make tests ", "has no target 'tests'"),
    ("examples/train_3d.py --tp 2", "examples/train_3d.py --tpp 2", "has no option --tpp"),
    ("examples/train_3d.py --tp 2", "examples/train3d.py --tp 2", "does not exist"),
    ("(docs/design.md)", "(docs/desing.md)", "points at no file"),
    ("autopart.plan_model(", "autopart.plan_modle(", "autopart.plan_modle is not in"),
    ("example_target=y, num_stages=2)", "example_target=y, num_stage=2)", "takes no num_stage="),
    ("pipe.save_plan(", "pipe.save_plna(", "pipe.save_plna does not exist"),
    ("`--pipeline-only`", "`--pipeline-onyl`", "takes --pipeline-onyl"),
]


@pytest.mark.parametrize(("right", "wrong", "reported"), MISTAKES, ids=[m[1] for m in MISTAKES])
def test_a_mistake_is_caught(right: str, wrong: str, reported: str) -> None:
    assert right in README, f"the README no longer says {right!r}: update MISTAKES"
    assert not any(reported in p for p in static_problems(README))
    broken = README.replace(right, wrong, 1)
    assert any(reported in p for p in static_problems(broken)), static_problems(broken)


def test_first_commands_are_checked() -> None:
    swapped = README.replace("make demo ", "make TEMP ", 1).replace("make test ", "make demo ", 1)
    assert first_commands(swapped) != ["make demo", "make test"]
