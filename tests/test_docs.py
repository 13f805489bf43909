"""The docs hold to the code: every relative link in README.md and docs/*.md resolves (the file, and a
#fragment to a heading of it), every `python -m anectypes...` command they quote parses with that
command's own argument parser, the README stays a five-minute read, and docs/architecture.md names
exactly the modules and packages of anectypes/ and web/.

A quoted command is checked as `python -m` would run it, up to the end of its argument parsing and no
further: its module runs (runpy) with argparse's parse_args replaced by one that parses for real and
then stops the command. Quoted commands are usage lines, so before parsing:
- a word in capitals (N, STEP, SOURCE, FILE) is a placeholder and is passed as "1", which every
  integer, number and string argument takes (`runs/<run>` is passed as it is: a string);
- `[...]` marks an optional part: every optional part is passed;
- `a|b|c` inside a word gives alternatives: the command is parsed once with each;
- `...` and `…` (more of the same) are dropped, and so is everything from a shell `#` comment, pipe,
  redirection, `&&` or `;` on, or from a quote that closes a string the command sits in (`bash -c '...'`).
A command quoted without arguments (`python -m anectypes.bench`) names the command: it must exist.
"""

import argparse
import importlib.util
import io
import os
import re
import runpy
import shlex
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 16 * 1024
PACKAGE_ROOTS = ("anectypes", "web")


# --- reading markdown -------------------------------------------------------------------------------------

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def split_code(text):
    """(the prose with every fenced code block blanked out, the code blocks' lines joined at `\\`)."""
    prose, blocks, fence = [], [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence, block = m.group(1), []
        elif fence is not None and m and m.group(1).startswith(fence):
            fence = blocks.append("\n".join(block).replace("\\\n", " "))
        elif fence is not None:
            block.append(line)
        else:
            prose.append(line)
            continue
        prose.append("")
    return "\n".join(prose), blocks


INLINE_CODE = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def slug(heading):
    """GitHub's anchor of a heading (github-slugger): its text, lower-cased, without punctuation, each
    space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # a link's text
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path):
    prose, _ = split_code(path.read_text())
    seen, out = {}, set(HTML_ANCHOR.findall(prose))
    for heading in HEADING.findall(prose):
        s = slug(heading)
        out.add(f"{s}-{seen[s]}" if s in seen else s)            # a repeated heading gets -1, -2, ...
        seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(page, root=ROOT):
    """Every relative link of the page that does not resolve, with the reason."""
    prose, _ = split_code(page.read_text())
    prose = INLINE_CODE.sub("", prose)
    out = []
    for target in LINK.findall(prose) + REFERENCE.findall(prose):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):           # https:, mailto: ...
            continue
        path, _, fragment = unquote(target).partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or root.resolve() not in (file, *file.parents):
            out.append(f"{target}: no file {path} in the checkout")
        elif fragment and (file.suffix != ".md" or fragment not in anchors(file)):
            out.append(f"{target}: no heading #{fragment} in {file.relative_to(root.resolve())}")
    return out


# --- the commands they quote ------------------------------------------------------------------------------

COMMAND = re.compile(r"\bpython3? -m (anectypes(?:\.\w+)*)([^\n]*)")
SHELL_END = ("|", ">", "<", "&", ";", "2>")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")


def quoted_commands(page):
    """(module, the rest of its line) of every `python -m anectypes...` in the page's code blocks and
    inline code."""
    prose, blocks = split_code(page.read_text())
    spans = [m.group(2).replace("\n", " ") for m in INLINE_CODE.finditer(prose)]
    return [m.groups() for text in blocks + spans for m in COMMAND.finditer(text)]


def argument_lists(rest):
    """The argument lists a usage line stands for (placeholders, optional parts and alternatives as the
    module's docstring says)."""
    try:
        split = shlex.split(rest, comments=True)
    except ValueError:                           # the command ends a quoted string: bash -c '... --scratch'
        split = shlex.split(rest[:max(rest.rfind("'"), rest.rfind('"'))], comments=True)
    words = []
    for word in split:
        if word.startswith(SHELL_END):
            break
        word = word.strip("[]")
        if word and word not in ("...", "…"):
            words.append(word)
    choices = [["1" if PLACEHOLDER.fullmatch(w) else w for w in word.split("|")] for word in words]
    n = max(map(len, choices), default=1)
    return [[alts[min(i, len(alts) - 1)] for alts in choices] for i in range(n)]


class Parsed(BaseException):
    """Raised by parse_args once the arguments parsed: the command goes no further."""


def parse_error(module, argv):
    """None when `python -m module argv` gets through its argument parsing, else its error."""
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    err = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop), \
            mock.patch.object(sys, "argv", [module, *argv]), redirect_stderr(err), redirect_stdout(io.StringIO()), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'anectypes.* found in sys.modules", RuntimeWarning)   # imported already
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except Parsed:
            return None
        except ImportError as e:
            return f"no module {module}: {e}"
        except SystemExit as e:
            return err.getvalue().strip() or f"exit {e.code}"
    return "it ran without parsing any arguments"


def runnable(module):
    """Whether `python -m module` is a command: a module, or a package with a __main__."""
    try:
        spec = importlib.util.find_spec(module)
        return spec is not None and (not spec.submodule_search_locations
                                     or importlib.util.find_spec(module + ".__main__") is not None)
    except ImportError:
        return False


def command_errors(page):
    out = []
    for module, rest in quoted_commands(page):
        for argv in argument_lists(rest):
            if argv:
                error = parse_error(module, argv)
            else:
                error = None if runnable(module) else "no such command"
            if error:
                out.append(f"python -m {module} {shlex.join(argv)}: {error}")
    return out


# --- the architecture page ------------------------------------------------------------------------------

def tree_modules(root=ROOT):
    """Every package (as `path/`, its __init__.py included) and every other .py module under anectypes/
    and web/ (anectypes/web is a symlink to web/, for running from a checkout)."""
    out = set()
    for top in PACKAGE_ROOTS:
        for folder, dirs, files in os.walk(root / top):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not (Path(folder) / d).is_symlink())
            rel = Path(folder).relative_to(root).as_posix()
            if "__init__.py" in files:
                out.add(rel + "/")
            out.update(f"{rel}/{f}" for f in files if f.endswith(".py") and f != "__init__.py")
    return out


def named_modules(text):
    """The paths under anectypes/ or web/ that a page names in inline code."""
    prose, _ = split_code(text)
    return {m.group(2) for m in INLINE_CODE.finditer(prose)
            if re.fullmatch(r"(?:anectypes|web)/[\w/.-]*", m.group(2))}


def architecture_errors(text, tree, root=ROOT):
    named = named_modules(text)
    return ([f"not on the page: {m}" for m in sorted(tree - named)]
            + [f"not in the tree: {m}" for m in sorted(named) if not (root / m).exists()])


# --- the tests --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_quoted_command_parses(page):
    assert command_errors(page) == []


def test_the_docs_quote_the_commands():
    """The command check sees the commands (the README's main job, and every command module)."""
    quoted = {module for page in PAGES for module, _ in quoted_commands(page)}
    assert {"anectypes.train", "anectypes.generate", "anectypes.export", "anectypes.dashboard",
            "anectypes.doctor", "anectypes.bench", "anectypes.mil"} <= quoted


def test_the_readme_is_a_five_minute_read():
    assert len((ROOT / "README.md").read_bytes()) <= README_LIMIT


def test_the_architecture_page_names_every_module_of_the_tree():
    assert architecture_errors((ROOT / "docs" / "architecture.md").read_text(), tree_modules()) == []


# --- the checks can fail ----------------------------------------------------------------------------------

def test_slugs_are_githubs():
    assert slug("`cblas_sgemm` through ctypes") == "cblas_sgemm-through-ctypes"
    assert slug("Speed against llama2.c's run.c") == "speed-against-llama2cs-runc"
    assert slug("Checkpoints, resume and the compile budget") == "checkpoints-resume-and-the-compile-budget"
    assert slug("Train / generate") == "train--generate"


def test_broken_links_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md) [ok](other.md#twice-1) [ok](#page) `[code](gone.md)`\n"
                    "[file](gone.md) [fragment](other.md#nowhere) [here](#nowhere)\n"
                    "```\n[in a block](gone-too.md)\n```\n[out of the checkout](../x.md) [web](https://x.org/)\n")
    assert broken_links(page, tmp_path) == [
        "gone.md: no file gone.md in the checkout", "other.md#nowhere: no heading #nowhere in other.md",
        "#nowhere: no heading #nowhere in page.md", "../x.md: no file ../x.md in the checkout"]


def test_usage_lines_stand_for_argument_lists():
    assert argument_lists("run K.mil --out DIR [--precision fp16|fp32] ... | head  # note") == [
        ["run", "K.mil", "--out", "1", "--precision", "fp16"], ["run", "K.mil", "--out", "1", "--precision", "fp32"]]
    assert argument_lists("--checkpoint latest|FILE > /dev/null") == [["--checkpoint", "latest"], ["--checkpoint", "1"]]


def test_a_wrong_command_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```sh\npython -m anectypes.train --scratch --ranks N --no-such-flag\n```\n"
                    "`python -m anectypes.mil check FILE.mil --chip m9` and `python -m anectypes.nosuch --x`\n"
                    "`python -m anectypes.generate runs/<run> --steps N --top-p P`, `python -m anectypes.bench`,\n"
                    "`python -m anectypes.model` `python -m anectypes.nosuch`\n")
    errors = command_errors(page)
    assert len(errors) == 5
    assert "unrecognized arguments: --no-such-flag" in errors[0]
    assert "invalid choice: 'm9'" in errors[1]
    assert errors[2].startswith("python -m anectypes.nosuch --x: no module anectypes.nosuch")
    assert errors[3:] == ["python -m anectypes.model : no such command", "python -m anectypes.nosuch : no such command"]


def test_the_architecture_check_finds_what_is_missing_and_what_is_gone(tmp_path):
    for f in ("pkg/__init__.py", "pkg/a.py", "pkg/b.py"):
        (tmp_path / "anectypes" / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "anectypes" / f).write_text("")
    (tmp_path / "web").mkdir()
    tree = tree_modules(tmp_path)
    assert tree == {"anectypes/pkg/", "anectypes/pkg/a.py", "anectypes/pkg/b.py"}
    page = "- `anectypes/pkg/`: a package\n- `anectypes/pkg/a.py`: a\n- `anectypes/pkg/gone.py`: moved away\n"
    assert architecture_errors(page, tree, tmp_path) == ["not on the page: anectypes/pkg/b.py",
                                                          "not in the tree: anectypes/pkg/gone.py"]
