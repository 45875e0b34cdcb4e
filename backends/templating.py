"""The jinja2 environment a backend renders its templates (<backend package>/templates/*.j2) with."""
from __future__ import annotations

import unicodedata
from functools import lru_cache
from importlib import resources

import jinja2


@lru_cache(maxsize=None)
def environment(package: str) -> jinja2.Environment:
    """The templates of `package` (a backend's sub-package, e.g. "linrec.c"): strict (an undefined name is an
    error), with block tags that leave no blank lines behind."""
    folder = resources.files(package).joinpath("templates")

    def source(name: str) -> str:
        return folder.joinpath(name).read_text(encoding="utf-8")
    env = jinja2.Environment(loader=jinja2.FunctionLoader(source), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["c_comment"] = c_comment_text  # user text inside a C comment: {{ filename | c_comment }}
    env.filters["py_comment"] = python_comment_text
    return env


# ---- user text inside generated code ---------------------------------------------------------------------
# A program's file name, its source lines and expressions quoted from it appear in the comments of generated
# files, so that a reader sees where the code came from. Such text must never end the comment it stands in:
# a path holding `*/`, a newline and a C function would otherwise become code that runs when the kernel
# loads. Every piece of user text reaches a comment through these two functions and nothing else.
_INVISIBLE = ("Cc", "Cf", "Zl", "Zp")  # control and format characters, line and paragraph separators
_ESCAPES = {"\n": "\\n", "\r": "\\r"}


def _escape(ch: str) -> str:
    if ch != "\t" and unicodedata.category(ch) in _INVISIBLE:
        return _ESCAPES.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
    return ch


def python_comment_text(text: str) -> str:
    """`text` as it may follow `#` in generated Python: on one line, control characters (line ends included)
    and invisible format characters (bidirectional overrides) shown as escapes."""
    return "".join(_escape(ch) for ch in str(text))


def c_comment_text(text: str) -> str:
    """`text` as it may stand inside a C block comment: python_comment_text's, with the comment's delimiters
    broken apart (`*/` → `* /`, and `/*`, which gcc warns about inside a comment, → `/ *`), and question marks
    in pairs too (`??` → `? ?`): `??/` and the other trigraphs draw gcc's -Wtrigraphs in every mode, comments
    included, so an engine built with -Werror would fail on a program's comment."""
    text = python_comment_text(text)
    while "*/" in text or "/*" in text or "??" in text:
        text = text.replace("*/", "* /").replace("/*", "/ *").replace("??", "? ?")
    return text


def comment_lines(text: str, prefix: str, c: bool) -> str:
    """A multi-line user text (a program's source) as comment lines, each `prefix` + the line made safe."""
    safe = c_comment_text if c else python_comment_text
    return "\n".join(prefix + safe(line) for line in str(text).splitlines())
