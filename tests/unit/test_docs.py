"""The documentation cannot drift from the code silently.

* Every relative link between ``docs/*.md`` and ``README.md`` resolves: the file, and
  the heading when the link names one.
* Every ``clusterflow <command>`` written as a command line on any page, with its
  options, exists in the CLI; every option ``docs/cli.md`` names in a command's section
  is one of that command's; and every command and option of the CLI is documented in
  ``docs/cli.md``. The CLI is read from click's command objects, not from a subprocess.
* Code blocks are run by ``tests/unit/test_doc_snippets.py`` (and, for those that need
  a cluster, ``tests/integration/test_doc_snippets_in_cluster.py``).
* Every citation "docs/architecture.md section N" in ``src/``, ``docs/``, ``tests/`` and
  ``benchmarks/`` names a section the page has, and nothing cites a map outside the
  repository; every module path the page names exists, unless its paragraph (or table
  row) marks it as planned.

Work in progress is tolerated only where it is listed below and marked on the page, so
a listed option that lands (or a page that appears) makes a test fail until the list
and the page are brought up to date.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import click

from clusterflow.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CLI_PAGE = DOCS / "cli.md"
ARCHITECTURE_PAGE = DOCS / "architecture.md"
CITING_TREES = ("src", "docs", "tests", "benchmarks", "examples")
CONCEPTS_PAGE = DOCS / "concepts.md"

PENDING_START_OPTIONS: tuple[str, ...] = ()
"""Options of ``clusterflow start`` being added now. docs/cli.md may name them only
between its ``pending-options`` markers; once one exists in the CLI, document it with
the others and drop it from this list (a test says so)."""

PENDING_PAGES: tuple[str, ...] = ()
"""Pages being written now: links to them are tolerated while they do not exist."""

PENDING_BEGIN = "<!-- pending-options: start -->"
PENDING_END = "<!-- /pending-options -->"
SHELL_LANGUAGES = frozenset({"", "sh", "bash", "shell", "console", "text"})
GLOBAL_OPTIONS = frozenset({"-h", "--help", "-V", "--version"})

_FENCE = re.compile(r"^\s*```(\S*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_COMMAND = re.compile(r"(?:^|(?<=[\s/(]))clusterflow[ \t]+([A-Za-z][\w-]*)")
_OPTION_TOKEN = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
_OPTION_SPAN = re.compile(r"(--?[A-Za-z][\w-]*)(?:[ =].*)?")
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_CUTS = (" -- ", " #", "|", "&&", ";", ">")


# Reading pages --------------------------------------------------------------------------


@dataclass(slots=True)
class Block:
    """A fenced code block."""

    language: str
    text: str
    line: int
    """Line number of its first line of code (1-based)."""


@dataclass(slots=True)
class Prose:
    """A line outside code blocks, with the headings it sits under."""

    text: str
    line: int
    section: str
    """The text of the nearest level-2 heading above it ('' before the first)."""
    pending: bool
    """Whether it lies between the pending-options markers."""


@dataclass(slots=True)
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    prose: list[Prose] = field(default_factory=list)
    headings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


def read_page(path: Path) -> Page:
    page = Page(path)
    fence: str | None = None
    code: list[str] = []
    start = 0
    section = ""
    pending = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = _FENCE.match(line)
        if fence is not None:
            if match and not match.group(1):
                page.blocks.append(Block(fence, "\n".join(code), start))
                fence, code = None, []
            else:
                code.append(line)
            continue
        if match:
            fence, start = match.group(1).lower(), number + 1
            continue
        if line.strip() == PENDING_BEGIN:
            pending = True
        elif line.strip() == PENDING_END:
            pending = False
        heading = _HEADING.match(line)
        if heading:
            page.headings.append(heading.group(2))
            if len(heading.group(1)) == 2:
                section = heading.group(2)
        page.prose.append(Prose(line, number, section, pending))
    assert fence is None, f"{page.name}: a code block opened on line {start - 1} never closes"
    return page


def doc_pages() -> list[Page]:
    return [read_page(p) for p in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Page) -> set[str]:
    found: set[str] = set()
    for heading in page.headings:
        base = slug(heading)
        name, n = base, 0
        while name in found:
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


# Reading the CLI ------------------------------------------------------------------------


def commands() -> dict[str, click.Command]:
    assert isinstance(cli, click.Group)
    return dict(cli.commands)


def options_of(command: click.Command) -> set[str]:
    """Every spelling of every option of ``command`` (``-c`` and ``--config``), and help."""
    names = set(GLOBAL_OPTIONS - {"-V", "--version"})
    for param in command.params:
        if isinstance(param, click.Option):
            names.update(param.opts)
            names.update(param.secondary_opts)
    if isinstance(command, click.Group) and command is not cli:  # `cache create --from`
        for sub in command.commands.values():
            names |= options_of(sub)
    return names


def group_options() -> set[str]:
    return options_of(cli)


# Command lines ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CommandLine:
    page: str
    line: int
    command: str
    options: tuple[str, ...]
    pending: bool


def command_lines(page: Page) -> Iterator[CommandLine]:
    """``clusterflow <command> [options]`` wherever a page writes one as code.

    Code is a shell-like block, an inline code span, or a code span inside a Python
    block's comment. What follows `` -- `` is the job's command, not ours, and quoted
    strings are values, so neither is read for options.
    """
    texts: list[tuple[str, int, bool]] = []
    for prose in page.prose:
        texts += [(span, prose.line, prose.pending) for span in _SPAN.findall(prose.text)]
    for block in page.blocks:
        for offset, code in enumerate(block.text.splitlines()):
            if block.language in SHELL_LANGUAGES:
                texts.append((code, block.line + offset, False))
            elif block.language == "python":
                texts += [(s, block.line + offset, False) for s in _SPAN.findall(code)]
    for text, line, pending in texts:
        matches = list(_COMMAND.finditer(text))
        for i, match in enumerate(matches):
            name = match.group(1)
            if name.isupper():  # a placeholder: `clusterflow COMMAND -h`
                continue
            end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
            rest = _QUOTED.sub("", text[match.end() : end])
            for cut in _CUTS:
                rest = rest.split(cut)[0]
            yield CommandLine(page.name, line, name, tuple(_OPTION_TOKEN.findall(rest)), pending)


def option_spans(page: Page) -> Iterator[tuple[Prose, str]]:
    """Options a page names in prose, as a code span of their own: `--grace SECONDS`."""
    for prose in page.prose:
        for span in _SPAN.findall(prose.text):
            match = _OPTION_SPAN.fullmatch(span)
            if match:
                yield prose, match.group(1)


def section_command(section: str) -> str | None:
    """``start`` for the section headed ``clusterflow start`` of docs/cli.md."""
    match = re.fullmatch(r"`?clusterflow ([a-z][\w-]*)`?", section)
    return match.group(1) if match else None


def pending_span(page: Page) -> list[Prose]:
    return [p for p in page.prose if p.pending]


# Tests: links ---------------------------------------------------------------------------


def test_every_relative_link_resolves() -> None:
    pages = {page.path: page for page in doc_pages()}
    problems = []
    for page in pages.values():
        targets = []
        for prose in page.prose:
            text = _SPAN.sub("", prose.text)  # a link inside a code span is code
            targets += [(t, prose.line) for t in _LINK.findall(text)]
            reference = _REFERENCE.match(text)
            if reference:
                targets.append((reference.group(1), prose.line))
        for target, line in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            path = (page.path.parent / path_part).resolve() if path_part else page.path
            where = f"{page.name}:{line}: link to {target!r}"
            if not path.exists():
                relative = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                if str(relative) not in PENDING_PAGES:
                    problems.append(f"{where}: no such file")
                continue
            if anchor and path.suffix == ".md":
                target_page = pages.get(path) or read_page(path)
                if anchor not in anchors(target_page):
                    problems.append(f"{where}: no heading #{anchor} in {target_page.name}")
    assert not problems, "\n".join(problems)


def test_pending_pages_are_still_pending() -> None:
    landed = [name for name in PENDING_PAGES if (ROOT / name).exists()]
    assert not landed, (
        f"{', '.join(landed)} exists now: remove it from PENDING_PAGES in {Path(__file__).name}"
    )


# Tests: the CLI -------------------------------------------------------------------------


def test_every_command_line_on_every_page_exists_in_the_cli() -> None:
    known = commands()
    problems = []
    for page in doc_pages():
        for line in command_lines(page):
            where = f"{line.page}:{line.line}: clusterflow {line.command}"
            command = known.get(line.command)
            if command is None:
                problems.append(f"{where}: no such command (commands: {', '.join(known)})")
                continue
            allowed = options_of(command)
            if line.pending and line.command == "start":
                allowed |= set(PENDING_START_OPTIONS)
            problems += [f"{where}: no option {o}" for o in line.options if o not in allowed]
    assert not problems, "\n".join(problems)


def test_every_option_cli_md_names_belongs_to_its_command() -> None:
    page = read_page(CLI_PAGE)
    known = commands()
    anywhere = group_options().union(*(options_of(c) for c in known.values()))
    problems = []
    for prose, option in option_spans(page):
        name = section_command(prose.section)
        where = f"{page.name}:{prose.line}: {option}"
        if name is None:
            if option not in anywhere:
                problems.append(f"{where}: no command has this option")
            continue
        command = known.get(name)
        if command is None:
            problems.append(f"{where}: section of unknown command {name!r}")
            continue
        allowed = options_of(command)
        if prose.pending and name == "start":
            allowed |= set(PENDING_START_OPTIONS)
        if option not in allowed:
            problems.append(f"{where}: not an option of clusterflow {name}")
    assert not problems, "\n".join(problems)


def test_every_command_and_option_of_the_cli_is_documented() -> None:
    page = read_page(CLI_PAGE)
    sections = {section_command(p.section) for p in page.prose} - {None}
    named: dict[str | None, set[str]] = {}
    for prose, option in option_spans(page):
        named.setdefault(section_command(prose.section), set()).add(option)
    problems = []
    for name, command in commands().items():
        if name not in sections:
            problems.append(f"clusterflow {name}: no section headed `clusterflow {name}`")
            continue
        missing = sorted(options_of(command) - GLOBAL_OPTIONS - named.get(name, set()))
        problems += [f"clusterflow {name}: option {o} is not described" for o in missing]
    missing = sorted(group_options() - named.get(None, set()))
    problems += [f"global option {o} is not described" for o in missing]
    assert not problems, "\n".join(problems)


def test_pending_section_lists_exactly_the_pending_options() -> None:
    page = read_page(CLI_PAGE)
    lines = pending_span(page)
    if not PENDING_START_OPTIONS:
        assert not lines, f"{page.name} still has a pending-options section; remove it"
        return
    assert lines, f"{page.name} has no {PENDING_BEGIN} section for {PENDING_START_OPTIONS}"
    assert {section_command(p.section) for p in lines} == {"start"}, (
        "the pending-options section must sit in the section of `clusterflow start`"
    )
    named = {
        match.group(1)
        for p in lines
        for s in _SPAN.findall(p.text)
        if (match := _OPTION_SPAN.fullmatch(s))
    }
    assert named == set(PENDING_START_OPTIONS)


def test_pending_options_have_not_landed() -> None:
    landed = sorted(set(PENDING_START_OPTIONS) & options_of(commands()["start"]))
    assert not landed, (
        f"clusterflow start has {', '.join(landed)} now: describe it in the options table of "
        f"docs/cli.md and remove it from the pending-options section and from "
        f"PENDING_START_OPTIONS in {Path(__file__).name}"
    )


# Tests: the architecture page ----------------------------------------------------------

_CITATION = re.compile(r"architecture\.md\]?(?:\([^)]*\))?,? (?:section|s\.) (\d+[a-z]?)\b")
_SECTION = re.compile(r"^(\d+[a-z]?)\. ")
_OUTSIDE_MAP = "ARCHITECTURE" + ".md"  # the old map outside the repository
_MODULE_PATH = re.compile(r"`((?:[\w.]+/)+[\w.]*\.py)`")


def architecture_sections() -> set[str]:
    page = read_page(ARCHITECTURE_PAGE)
    return {m.group(1) for h in page.headings if (m := _SECTION.match(h))}


def citing_files() -> Iterator[Path]:
    for tree in CITING_TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if path.suffix in {".py", ".md"} and ".venv" not in path.parts:
                yield path
    yield ROOT / "README.md"


def test_architecture_page_has_its_numbered_sections() -> None:
    assert {"1", "2", "3", "3b", "4", "5", "6", "6b", "6c", "7", "8"} <= architecture_sections()


def test_every_architecture_citation_names_a_section_that_exists() -> None:
    sections = architecture_sections()
    problems = []
    cited = 0
    for path in citing_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            if _OUTSIDE_MAP in line:
                problems.append(f"{where}: cites {_OUTSIDE_MAP}, which is not in the repository")
            for match in _CITATION.finditer(line):
                cited += 1
                if match.group(1) not in sections:
                    problems.append(f"{where}: docs/architecture.md has no section {match[1]}")
    assert not problems, "\n".join(problems)
    assert cited >= 20, f"only {cited} citations found: is the pattern still right?"


def test_architecture_page_names_only_modules_that_exist_or_are_planned() -> None:
    text = ARCHITECTURE_PAGE.read_text(encoding="utf-8")
    paragraphs: list[str] = []
    for block in text.split("\n\n"):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        paragraphs += rows if rows else [block]
    problems = []
    for paragraph in paragraphs:
        for name in _MODULE_PATH.findall(paragraph):
            exists = (ROOT / "src" / "clusterflow" / name).exists() or (ROOT / name).exists()
            if not exists and "planned" not in paragraph.lower():
                problems.append(f"{name}: no such module, and not marked planned")
    assert not problems, "\n".join(problems)


def test_the_architecture_page_is_linked_from_the_readme_and_the_docs() -> None:
    assert "docs/architecture.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "architecture.md" in CONCEPTS_PAGE.read_text(encoding="utf-8")


# Tests: the README's commands and CI ----------------------------------------------------

_CI_SCRIPT = ROOT / ".ci" / "run"
_INSTALL_CHROMIUM = re.compile(r"command -v chromium >/dev/null \|\| \{[^}]*apt-get install[^}]*\}")
_PIP_INSTALL = re.compile(r"pip install (?:-q )?(-c ci/constraints\.txt -e '\.\[test\]')")


def test_readmes_suite_command_installs_what_ci_installs() -> None:
    """Pins the README's second command to ``.ci/run``: both install Debian's chromium when
    it is missing, with the same line (the README's command once lacked it, so it failed
    on a fresh machine while CI passed), install the same pinned test extras, and run
    pytest from the venv; and the README says what the suite needs from the system."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    page = read_page(ROOT / "README.md")
    command = next(b.text for b in page.blocks if "pytest" in b.text)
    ci = _CI_SCRIPT.read_text(encoding="utf-8")
    chromium = [m.group(0) for m in _INSTALL_CHROMIUM.finditer(command)]
    assert chromium, f"the README's suite command does not install chromium: {command}"
    assert chromium == [m.group(0) for m in _INSTALL_CHROMIUM.finditer(ci)]
    assert _PIP_INSTALL.findall(command) == _PIP_INSTALL.findall(ci) != []
    assert ".venv/bin/python -m pytest" in command and ".venv/bin/python -m pytest" in ci
    for need in ("Python 3.11", "chromium", "root", "iproute2"):
        assert need in readme, f"the README does not say the suite needs {need}"


# Tests: docs/cli.md and --help list the same things -----------------------------------

_KEY_ROW = re.compile(r"^\| `(\w+)` \|")
_CHOICES_SPAN = re.compile(r"^(--[\w-]+) ([\w-]+(?:\\?\|[\w-]+)+)$")


def visible_options(command: click.Command) -> set[str]:
    """What ``command --help`` lists (with a group's subcommands' for ``cache`` and
    ``tune``, which cli.md documents in one section each), but ``-h``/``--help``."""
    names: set[str] = set()
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            names.update(param.opts)
            names.update(param.secondary_opts)
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            names |= visible_options(sub)
    return names - GLOBAL_OPTIONS


def test_cli_md_and_help_list_the_same_options() -> None:
    """Pins docs/cli.md to ``--help``, both ways and command by command: the options a
    command's section names are exactly those its ``--help`` (and its subcommands')
    lists; and where a section gives an option's values (`--backend local|ray`), they
    are the values ``--help`` offers (``tune -h`` offered `hosts`, which no page named)."""
    page = read_page(CLI_PAGE)
    named: dict[str, set[str]] = {}
    values: dict[tuple[str, str], set[str]] = {}
    for prose, option in option_spans(page):
        name = section_command(prose.section)
        if name is None:
            continue
        named.setdefault(name, set()).add(option)
        for span in _SPAN.findall(prose.text):
            match = _CHOICES_SPAN.match(span)
            if match and match.group(1) == option:
                values[(name, option)] = set(match.group(2).replace("\\|", "|").split("|"))
    problems = []
    for name, command in commands().items():
        shown, documented = visible_options(command), named.get(name, set()) - GLOBAL_OPTIONS
        problems += [
            f"clusterflow {name} -h lists {o}; cli.md does not" for o in shown - documented
        ]
        problems += [f"cli.md names {o} for {name}; -h does not" for o in documented - shown]
        params = [command, *getattr(command, "commands", {}).values()]
        for param in (p for c in params for p in c.params):
            if not isinstance(param, click.Option) or not isinstance(param.type, click.Choice):
                continue
            offered = {str(c) for c in param.type.choices}
            written = values.get((name, param.opts[0]))
            if written is not None and written != offered:
                problems.append(
                    f"clusterflow {name} {param.opts[0]}: -h offers {sorted(offered)}, "
                    f"cli.md {sorted(written)}"
                )
    assert values, "no `--option a|b` span found: is the pattern still right?"
    assert not problems, "\n".join(problems)


def test_cluster_file_table_lists_every_key_start_accepts() -> None:
    """Pins the cluster file's table in docs/cli.md to ``FILE_KEYS``: ``cache`` was
    accepted and not documented."""
    from clusterflow.manager.config import FILE_KEYS

    text = CLI_PAGE.read_text(encoding="utf-8")
    section = text.split("### The cluster file", 1)[1].split("\n#", 1)[0]
    keys = {m.group(1) for line in section.splitlines() if (m := _KEY_ROW.match(line))}
    assert keys == FILE_KEYS, (sorted(FILE_KEYS - keys), sorted(keys - FILE_KEYS))
