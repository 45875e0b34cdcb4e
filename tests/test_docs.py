"""The docs run: every fenced code block in README.md and docs/*.md is executed, so they cannot drift from
the code. Also: every command's --help works.

A block's language tag says how it runs:

    ```python   runs; the blocks of one page run in order and share one namespace. An ```text block right
                after it is its expected standard output.
    ```sh       each command line runs through the shell with the installed `linrec`, and must exit 0
                (write `cmd; echo "exit status: $?"` to show a failure). In a block of `$ command` lines,
                the lines after each command are its expected output (stdout and stderr, as a terminal
                shows them; none: no output). After a block without `$`, an ```text block is the expected
                output of all its commands.
    ```lin      a program, compiled with linrec.compile. An ```text block right after it is the error it
                must fail with.
    ```text     an expected output, only right after one of the above (blank lines between, no prose).

Outputs are compared whole after whitespace is normalized (every run of spaces and newlines is one space);
`…` in an expected output matches any text. Each page runs in a temporary directory of its own, where
`examples/` is the repository's.

A marker, an HTML comment on a line of its own right before a block, changes how it runs:

    <!-- docs-test: skip — REASON -->    the block does not run (a block that cannot: the set-up commands,
                                         a long benchmark). REASON is required.
    <!-- docs-test: xfail — REASON -->   a documented behaviour that is broken: the block runs and must fail.
    <!-- docs-test: error — REASON -->   a ```lin block that must fail to compile, its error shown elsewhere
                                         (REASON says where: e.g. by the command after it).
    <!-- docs-test: file NAME -->        a ```lin block is also saved as NAME in the page's directory, for
                                         the commands after it.

A page about an optional extra runs only where the extra is installed (OPTIONAL: docs/torch.md needs
`linrec[torch]`, which CI installs); without it, its blocks are skipped.

An untagged block, a tag not listed here, a marker without a reason or without a block after it, and an
output block with nothing before it to compare with are errors. docs/index.md must list every page, and
links between the pages must reach a file and a heading.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import linrec
from linrec.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = ("python", "sh", "lin")
OUTPUT = "text"
WILDCARD = "…"
OPTIONAL = {"torch.md": "torch"}  # page → the module of the optional extra it needs (pyproject's extras)
COMMAND_TIMEOUT_S = 300
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
REASONED = re.compile(r"^(?P<kind>skip|xfail|error)\s*(?:[—:-]+\s*(?P<reason>.*))?$")
FILE_NAME = re.compile(r"^file\s+(?P<name>[\w.-]+)$")


# ---- reading a page ----------------------------------------------------------------------------------------
@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    tag: str
    text: str
    skip: str | None = None  # the reason, when marked
    xfail: str | None = None
    error: str | None = None  # a ```lin block that must fail to compile; where its error is shown
    file: str | None = None
    output: "Block | None" = None  # the ```text block right after it

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name}:{self.line}"


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)  # runnable blocks, in order (outputs attached)
    problems: list[str] = field(default_factory=list)


def read_page(path: Path, text: str | None = None) -> Page:
    """The page's runnable blocks with their markers and expected outputs, and what is wrong with its blocks."""
    page = Page(path)
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    where = lambda n: f"{path.name}:{n}"  # noqa: E731
    markers: list[tuple[int, str]] = []
    previous: Block | None = None  # the last runnable block, while only blank lines follow it
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        fence = FENCE.match(line)
        if marker:
            markers.append((i + 1, marker["body"]))
            previous = None
            i += 1
            continue
        if not fence:
            if re.match(r"^\s{4,}(`{3}|~{3})", line):
                page.problems.append(f"{where(i + 1)}: a code fence indented by 4 or more spaces, which the docs "
                                     f"test does not read; indent it less")
            if line.strip():
                previous = None
                if markers:
                    page.problems.append(f"{where(markers[-1][0])}: a docs-test marker with no code block after it")
                    markers = []
            i += 1
            continue
        start, indent, closing = i + 1, len(fence["indent"]), fence["fence"]
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(rf"^ {{0,3}}{closing[0]}{{{len(closing)},}}\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i].lstrip())
            i += 1
        if i == len(lines):
            page.problems.append(f"{where(start)}: a code block that is never closed")
        i += 1
        tag = fence["info"].split()[0] if fence["info"] else ""
        block = Block(path, start, tag, "\n".join(body) + "\n")
        for line_number, body_text in markers:
            _apply_marker(block, body_text, f"{where(line_number)}", page.problems)
        markers = []
        if not tag:
            page.problems.append(f"{where(start)}: a code block without a language tag; tag it "
                                 f"{', '.join(RUNNABLE + (OUTPUT,))}")
        elif tag == OUTPUT:
            if previous is None or previous.output is not None:
                if block.skip is None:
                    page.problems.append(f"{where(start)}: an output block (```{OUTPUT}) with no code block right "
                                         f"before it to compare with; mark it skip with a reason if it shows "
                                         f"something else")
            elif block.skip or block.xfail or block.error or block.file:
                page.problems.append(f"{where(start)}: a marker on an output block; put it on the block before")
            else:
                previous.output = block
            previous = None
            continue
        elif tag not in RUNNABLE:
            page.problems.append(f"{where(start)}: unknown language tag '{tag}'; use one of "
                                 f"{', '.join(RUNNABLE + (OUTPUT,))}")
        else:
            if (block.file or block.error) and tag != "lin":
                page.problems.append(f"{where(start)}: 'file' and 'error' apply to ```lin blocks only")
            page.blocks.append(block)
        previous = block if tag in RUNNABLE else None
    if markers:
        page.problems.append(f"{where(markers[-1][0])}: a docs-test marker with no code block after it")
    return page


def _apply_marker(block: Block, body: str, where: str, problems: list[str]) -> None:
    reasoned, file_name = REASONED.match(body), FILE_NAME.match(body)
    if reasoned:
        reason = (reasoned["reason"] or "").strip()
        if not reason:
            problems.append(f"{where}: '{reasoned['kind']}' without a reason; write "
                            f"<!-- docs-test: {reasoned['kind']} — why -->")
            reason = "(no reason given)"
        setattr(block, reasoned["kind"], reason)
    elif file_name:
        block.file = file_name["name"]
    else:
        problems.append(f"{where}: unknown docs-test marker '{body}'; use skip — REASON, xfail — REASON, "
                        f"error — REASON or file NAME")


# ---- comparing outputs -------------------------------------------------------------------------------------
def normalized(text: str) -> str:
    return " ".join(text.split())


def output_matches(expected: str, actual: str) -> bool:
    """Whole-text comparison after whitespace normalization; `…` in `expected` matches any text."""
    pieces = [re.escape(normalized(piece)) for piece in expected.split(WILDCARD)]
    return re.fullmatch(r"\s*" + r".*?".join(pieces) + r"\s*", normalized(actual), re.DOTALL) is not None


def check_output(expected: str, actual: str, what: str) -> None:
    if not output_matches(expected, actual):
        raise AssertionError(f"{what}: the output differs from the docs\n"
                             f"--- documented ({WILDCARD} matches anything):\n{expected.rstrip()}\n"
                             f"--- actual:\n{actual.rstrip()}")


# ---- running a page ----------------------------------------------------------------------------------------
def shell_environment() -> dict[str, str]:
    """The test's environment (its kernel cache included), with this Python's `linrec` and `python` first."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONIOENCODING"] = "utf-8"
    env.pop("LINREC_DEBUG", None)
    return env


def command_lines(text: str) -> list[tuple[str, str | None]]:
    """(command, expected output or None) per command of a ```sh block; `\\` continues a line."""
    lines = text.splitlines()
    prompted = any(line.startswith("$ ") for line in lines)
    commands: list[tuple[str, list[str] | None]] = []
    pending = ""
    for line in lines:
        if pending:
            pending += "\n" + line
        elif prompted and line.startswith("$ "):
            pending = line[2:]
        elif prompted:
            if not commands:
                raise AssertionError(f"output before the first `$ command` line: {line!r}")
            commands[-1][1].append(line)
            continue
        elif line.strip() and not line.lstrip().startswith("#"):
            pending = line
        else:
            continue
        if pending.endswith("\\"):
            continue
        commands.append((pending, [] if prompted else None))
        pending = ""
    if pending:
        raise AssertionError(f"a command ends with a line continuation: {pending!r}")
    return [(cmd, None if out is None else "\n".join(out)) for cmd, out in commands]


class PageRun:
    """One page's working directory and Python namespace; runs its blocks in order, each once."""

    def __init__(self, page: Page, directory: Path):
        self.page = page
        self.directory = directory
        (directory / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
        self.namespace: dict = {"__name__": "__docs__"}
        self.outcomes: dict[int, BaseException | None] = {}  # block index → what it raised

    def run_through(self, index: int) -> None:
        """Run every block up to `index` that has not run; raise what block `index` raised. A block runs
        whatever happened to the blocks before it; its failure names theirs (it may follow from them)."""
        for earlier in range(index + 1):
            if self.page.blocks[earlier].skip is None and earlier not in self.outcomes:
                self.outcomes[earlier] = self._outcome(self.page.blocks[earlier])
        failure = self.outcomes[index]
        if failure is None:
            return
        before = [self.page.blocks[i].where for i in range(index)
                  if self.outcomes.get(i) is not None and self.page.blocks[i].xfail is None]
        if before:
            raise AssertionError(f"{failure}\n(earlier blocks of this page failed too, which may be why: "
                                 f"{', '.join(before)})") from failure
        raise failure

    def _outcome(self, block: Block) -> BaseException | None:
        try:
            run_block(block, self.directory, self.namespace)
        except Exception as err:  # noqa: BLE001 - kept, and raised by the block's own test
            return err
        return None


def run_block(block: Block, directory: Path, namespace: dict) -> None:
    expected = block.output.text if block.output is not None else None
    if block.tag == "python":
        stdout = io.StringIO()
        with _working_directory(directory), contextlib.redirect_stdout(stdout):
            try:
                exec(compile(block.text, block.where, "exec"), namespace)  # noqa: S102 - the docs' own code
            except Exception as err:  # noqa: BLE001 - reported with the block's place and traceback
                trace = "".join(traceback.format_exception(err)[1:])
                raise AssertionError(f"{block.where}: the example raised {type(err).__name__}: {err}\n"
                                     f"{trace}") from err
        if expected is not None:
            check_output(expected, stdout.getvalue(), f"{block.where} (python)")
    elif block.tag == "sh":
        outputs = []
        for command, shown in command_lines(block.text):
            done = subprocess.run(command, shell=True, cwd=directory, env=shell_environment(),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=COMMAND_TIMEOUT_S)
            output = done.stdout.decode("utf-8", errors="replace")
            if done.returncode != 0:
                raise AssertionError(f"{block.where}: `{command}` exited with status {done.returncode}:\n"
                                     f"{output.rstrip()}")
            if shown is not None:
                check_output(shown, output, f"{block.where}: `{command}`")
            outputs.append(output)
        if expected is not None:
            check_output(expected, "".join(outputs), f"{block.where} (sh)")
    elif block.tag == "lin":
        if block.file:
            (directory / block.file).write_text(block.text, encoding="utf-8")
        try:
            linrec.compile(block.text, block.file or block.where)
        except linrec.LinrecError as err:
            if expected is None and block.error is None:
                raise AssertionError(f"{block.where}: the program does not compile:\n{err}") from None
            if expected is not None:
                check_output(expected, str(err), f"{block.where} (the program's error)")
        else:
            if expected is not None or block.error is not None:
                raise AssertionError(f"{block.where}: the program compiles, but the docs show it failing"
                                     + (f" with:\n{expected.rstrip()}" if expected is not None else ""))
    else:
        raise AssertionError(f"{block.where}: cannot run a ```{block.tag} block")


@contextlib.contextmanager
def _working_directory(path: Path):
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


# ---- the tests ---------------------------------------------------------------------------------------------
READ = {path: read_page(path) for path in PAGES}


def _block_cases():
    for path, page in READ.items():
        for index, block in enumerate(page.blocks):
            marks = []
            needs = OPTIONAL.get(path.name)
            if needs is not None and importlib.util.find_spec(needs) is None:
                marks.append(pytest.mark.skip(reason=f"{path.name} needs the optional extra linrec[{needs}]"))
            elif block.skip is not None:
                marks.append(pytest.mark.skip(reason=block.skip))
            elif block.xfail is not None:
                marks.append(pytest.mark.xfail(reason=block.xfail, strict=True))
            yield pytest.param(path, index, id=f"{block.where}-{block.tag}", marks=marks)


@pytest.fixture(scope="module")
def page_runs():
    root = Path(tempfile.mkdtemp(prefix="linrec-docs-"))
    runs: dict[Path, PageRun] = {}

    def get(path: Path) -> PageRun:
        if path not in runs:
            directory = root / path.stem
            directory.mkdir()
            runs[path] = PageRun(READ[path], directory)
        return runs[path]
    yield get
    shutil.rmtree(root, ignore_errors=True)


def test_the_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    links = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {path.name for path in PAGES if path.parent == ROOT / "docs" and path.name != "index.md"}
    assert pages and pages <= links, f"docs/index.md does not list {sorted(pages - links)}"
    assert {link for link in links if link != "../README.md"} <= pages | {"README.md"}
    for path in PAGES:
        assert path.name == "index.md" or READ[path].blocks, f"{path.name} has no code block to run"


def test_links_between_pages_resolve():
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(((?:\.\./|docs/)?[\w/.-]+\.md)?(?:#([\w-]+))?\)", text):
            file = (path.parent / target).resolve() if target else path
            assert file.exists(), f"{path.name}: a link to {target}, which does not exist"
            if anchor:
                assert anchor in _anchors(file), f"{path.name}: a link to {target}#{anchor}, which is no heading"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", path.read_text(encoding="utf-8"), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_every_block_is_tagged_and_every_marker_has_a_reason(path):
    problems = READ[path].problems
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path, index", list(_block_cases()))
def test_block_runs(path, index, page_runs):
    with _torch_grad_mode_kept():
        page_runs(path).run_through(index)


@contextlib.contextmanager
def _torch_grad_mode_kept():
    """Torch's global grad mode as it was before a page's blocks ran: docs/torch.md turns gradients off for its
    forward passes and on again pages later, so a worker that ran only its first blocks went on with them off,
    and a later test of gradients on that worker failed ("element 0 of tensors does not require grad")."""
    torch = sys.modules.get("torch")
    enabled = torch.is_grad_enabled() if torch is not None else None
    try:
        yield
    finally:
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_grad_enabled(True if enabled is None else enabled)


def test_the_readme_table_of_examples_says_what_check_says():
    """Every example is a row; its transition class and its forms (✓ or —) are what the compiler finds."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| \[`(\w+\.lin)`\]\(examples/\1\) \|(.*)\|\s*$", readme, re.MULTILINE)
    assert sorted(name for name, _ in rows) == sorted(path.name for path in (ROOT / "examples").glob("*.lin"))
    for name, rest in rows:
        _model, kind, *forms, _shows = (cell.strip() for cell in rest.split(" | "))
        rec = linrec.load(ROOT / "examples" / name)
        kinds = {t.kind for t in rec.decomposition.transitions}
        if rec.decomposition.sequence is not None:
            assert not kinds and kind == "— (reads the sequence)", name
        else:
            said = {re.sub(r"^stage \d+: ", "", part).removesuffix(" (stabilized)") for part in kind.split("; ")}
            assert kinds == said, f"{name}: the table says {kind!r}, check {kinds}"  # (a staged program: per stage)
        shown = tuple(form for form, cell in zip(("recurrent", "parallel", "chunkwise"), forms) if cell != "—")
        assert shown == rec.forms, f"{name}: the table shows the forms {shown}, the compiler finds {rec.forms}"


# ---- every command's --help ----------------------------------------------------------------------------------
HELP = [[], *([name] for name in COMMANDS), ["cache", "info"], ["cache", "clear"]]


@pytest.mark.parametrize("words", HELP, ids=lambda words: " ".join(["linrec", *words, "--help"]))
def test_help_exits_0(words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*words, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: linrec {' '.join(words[:1])}".rstrip()) and "options:" in out


def test_the_installed_command_shows_help():
    for command in (["linrec", "--help"], [sys.executable, "-m", "linrec", "--help"]):
        done = subprocess.run(command, env=shell_environment(), capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("usage: linrec") and all(name in done.stdout for name in COMMANDS)


# ---- the docs test itself fails when a block is wrong -----------------------------------------------------
def _run_text(tmp_path: Path, markdown: str) -> Page:
    """Read a page from text and run its blocks in tmp_path, as the docs test does."""
    page = read_page(tmp_path / "page.md", markdown)
    directory = tmp_path / "run"
    directory.mkdir()
    run = PageRun(page, directory)
    for index, block in enumerate(page.blocks):
        if block.skip is None:
            run.run_through(index)
    return page


GOOD_PROGRAM = """\
recurrence tiny(dk = 4, dv = 4)
input q[dk], k[dk], v[dv]
state S[dk, dv]
S = S + k⊗v
output o = q·S
"""


RIGHT_PAGE = f"""\
Words.

<!-- docs-test: file tiny.lin -->
```lin
{GOOD_PROGRAM}```

```sh
$ echo "a   b"; echo c
a b
c
$ ls tiny.lin examples/gla.lin
…tiny.lin
```

```python
x = 2
```

```python
print(x * 21, "and …")
```

```text
42 …
```

<!-- docs-test: skip — it would take an hour -->
```sh
sleep 3600
```

<!-- docs-test: error — the command after it shows the error -->
<!-- docs-test: file broken.lin -->
```lin
recurrence broken(
```

```sh
$ cat broken.lin
recurrence broken(
```
"""


def test_a_right_page_passes(tmp_path):
    page = _run_text(tmp_path, RIGHT_PAGE)
    assert not page.problems and len(page.blocks) == 7


@pytest.mark.parametrize("markdown, complaint", [
    ("```sh\n$ echo hello\nhullo\n```\n", "differs"),
    ("```sh\n$ echo hello\n```\n", "differs"),  # output that the docs do not show
    ("```sh\necho hello\n```\n\n```text\nhullo\n```\n", "differs"),
    ("```sh\nfalse\n```\n", "exited with status 1"),
    ("```python\nprint('a')\n```\n\n```text\nb\n```\n", "differs"),
    ("```python\nraise ValueError('broken example')\n```\n", "broken example"),
    ("```lin\nrecurrence x(\n```\n", "does not compile"),
    (f"```lin\n{GOOD_PROGRAM}```\n\n```text\nerror: nothing\n```\n", "compiles, but"),
    (f"<!-- docs-test: error — shown below -->\n```lin\n{GOOD_PROGRAM}```\n", "compiles, but"),
    ("```lin\nrecurrence x(d = 2)\ninput a[d]\noutput o = a + b\n```\n\n```text\nsome other error\n```\n",
     "differs"),
])
def test_a_wrong_block_fails(tmp_path, markdown, complaint):
    with pytest.raises(AssertionError, match=complaint):
        _run_text(tmp_path, markdown)


@pytest.mark.parametrize("markdown, complaint", [
    ("```\nls\n```\n", "without a language tag"),
    ("```bash\nls\n```\n", "unknown language tag"),
    ("<!-- docs-test: skip -->\n```sh\nls\n```\n", "without a reason"),
    ("<!-- docs-test: skip — -->\n```sh\nls\n```\n", "without a reason"),
    ("<!-- docs-test: xfail -->\n```sh\nls\n```\n", "without a reason"),
    ("<!-- docs-test: error -->\n```lin\nrecurrence x(\n```\n", "without a reason"),
    ("<!-- docs-test: error — shown below -->\n```sh\nls\n```\n", "apply to ```lin blocks only"),
    ("<!-- docs-test: skip — no block follows -->\n\nSome prose.\n", "no code block after it"),
    ("<!-- docs-test: sometimes -->\n```sh\nls\n```\n", "unknown docs-test marker"),
    ("Prose.\n\n```text\noutput of nothing\n```\n", "no code block right before it"),
    ("```sh\nls\n```\n\nProse between.\n\n```text\nx\n```\n", "no code block right before it"),
    ("```sh\nls\n", "never closed"),
    ("* a list item\n\n    ```sh\n    ls\n    ```\n", "indented by 4 or more spaces"),
])
def test_a_badly_marked_page_is_a_problem(tmp_path, markdown, complaint):
    page = read_page(tmp_path / "page.md", markdown)
    assert any(complaint in problem for problem in page.problems), page.problems


def test_an_xfail_block_must_fail(tmp_path):
    page = read_page(tmp_path / "page.md", "<!-- docs-test: xfail — known bug -->\n```sh\ntrue\n```\n")
    assert page.blocks[0].xfail == "known bug"  # the block test is marked xfail(strict=True): a pass fails it
